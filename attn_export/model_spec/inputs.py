"""The one data loader: seeded numpy feeds for every runtime, masks included.

Feeds are numpy so that golden verification and ONNX Runtime need no torch. The same
(seed, sizes) always gives the same arrays, so any failure reproduces from its report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from attn_export.model_spec.cache import POSITIONS, cache_of
from attn_export.model_spec.distributions import DEFAULT, sample
from attn_export.model_spec.masks import PATTERN, fill_mask
from attn_export.model_spec.model import ModelSpec, TensorSpec, concrete_shape

__all__ = ["POSITION_NAMES", "draw_inputs", "int_values", "make_feeds", "make_tensor"]


def make_tensor(
    t: TensorSpec,
    sizes: Mapping[str, int],
    rng: np.random.Generator,
    *,
    case: str = PATTERN,
    distribution: str = DEFAULT,
    values: tuple[int, int] = (0, 7),
) -> np.ndarray:
    """One input at the given sizes; masks get their pattern, in the module's convention,
    and the named ``case`` (``masks.CASES``) where one is asked for; integers are drawn
    from ``values`` (``int_values``)."""
    shape = concrete_shape(t, sizes)
    if t.mask is not None:
        return fill_mask(t.mask, t.dtype, shape, rng, case)
    if t.dtype == "bool":
        return rng.random(shape) < 0.5
    if t.dtype.startswith("int"):
        return rng.integers(values[0], values[1], size=shape, endpoint=True).astype(t.dtype)
    return sample(distribution, rng, shape, t.dtype)


def make_feeds(
    spec: ModelSpec, sizes: Mapping[str, int], seed: int, *, case: str = PATTERN, distribution: str = DEFAULT
) -> dict[str, np.ndarray]:
    """Feeds for every input of ``spec``, in declaration order, seeded by ``seed``; masks
    follow the named ``case``, float inputs follow ``distribution`` (``model_spec.distributions``)."""
    return draw_inputs(spec, sizes, np.random.default_rng(seed), case=case, distribution=distribution)


def draw_inputs(
    spec: ModelSpec,
    sizes: Mapping[str, int],
    rng: np.random.Generator,
    which: Callable[[str], bool] = lambda name: True,
    *,
    case: str = PATTERN,
    distribution: str = DEFAULT,
) -> dict[str, np.ndarray]:
    """The inputs of ``spec`` that ``which`` takes, drawn from ``rng`` in declaration order,
    each integer input over its values (``int_values``)."""
    return {
        t.name: make_tensor(t, sizes, rng, case=case, distribution=distribution, values=int_values(spec, t))
        for t in spec.inputs
        if which(t.name)
    }


#: Integer inputs read as positions where they index no table (a rotary's arithmetic):
#: ``position_ids`` and the names other libraries give them (Hugging Face's ``cache_position``).
POSITION_NAMES = frozenset({POSITIONS, "positions", "position", "pos_ids", "cache_position"})


def int_values(spec: ModelSpec, t: TensorSpec) -> tuple[int, int]:
    """The least and greatest value an integer input is drawn from: as declared, else every
    value that reaches a row of the tables it indexes (``ModelSpec.vocab``), else for
    positions (``POSITION_NAMES``) every position: of a present, in a KV-cache decoder,
    else of its last axis; else 0..7. Ids past a few are where a clamped or truncated table
    shows, positions past a few where a rotary capped at some length does: drawn from 0..7,
    neither fails."""
    if t.values is not None:
        return t.values
    if t.name in spec.vocab:
        return spec.vocab[t.name]
    if t.name not in POSITION_NAMES or not t.is_ids or not t.shape or not isinstance(t.shape[-1], str):
        return 0, 7
    cache = cache_of(spec)
    if cache is not None:
        return 0, max(spec.dims[cache.past_dim].max + spec.dims[cache.seq_dim].max - 1, 0)
    return 0, max(spec.dims[t.shape[-1]].max - 1, 0)
