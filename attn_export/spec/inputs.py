"""The one data loader: seeded numpy feeds for every runtime, masks included.

Feeds are numpy so that golden verification and ONNX Runtime need no torch. The same
(seed, sizes) always gives the same arrays, so any failure reproduces from its report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from attn_export.spec.distributions import DEFAULT, sample
from attn_export.spec.masks import PATTERN, fill_mask
from attn_export.spec.model import ModelSpec, TensorSpec
from attn_export.spec.shapes import concrete_shape

__all__ = ["draw_inputs", "make_feeds", "make_tensor"]


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
    from ``values`` (``ModelSpec.int_values``)."""
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
    follow the named ``case``, float inputs follow ``distribution`` (``spec.distributions``)."""
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
    each integer input over its values (``ModelSpec.int_values``)."""
    return {
        t.name: make_tensor(t, sizes, rng, case=case, distribution=distribution, values=spec.int_values(t))
        for t in spec.inputs
        if which(t.name)
    }
