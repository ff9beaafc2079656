"""The one data loader: seeded numpy feeds for every runtime, masks included.

Feeds are numpy so that golden verification and ONNX Runtime need no torch. The same
(seed, sizes) always gives the same arrays, so any failure reproduces from its report.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attn_export.spec.distributions import DEFAULT, sample
from attn_export.spec.model import ModelSpec, TensorSpec
from attn_export.spec.shapes import concrete_shape

__all__ = ["make_feeds", "make_tensor"]


def _mask(t: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator, masked_row: bool) -> np.ndarray:
    seq, kv = shape[-2], shape[-1]
    if t.mask == "causal":
        mask = np.broadcast_to(np.tril(np.ones((seq, kv), dtype=bool)), shape).copy()
    elif t.mask == "padding":
        mask = np.zeros(shape, dtype=bool)
        for b in range(shape[0]):
            mask[b, ..., : rng.integers(1, kv + 1)] = True
    else:
        mask = rng.random(shape) < 0.75
    if masked_row:
        mask[(0,) * (len(shape) - 2) + (seq - 1,)] = False
    return mask


def make_tensor(
    t: TensorSpec,
    sizes: Mapping[str, int],
    rng: np.random.Generator,
    *,
    masked_row: bool = True,
    distribution: str = DEFAULT,
) -> np.ndarray:
    """One input at the given sizes; masks get their pattern and, by default, one fully
    masked query row (the last row of the first batch element)."""
    shape = concrete_shape(t, sizes)
    if t.mask is not None:
        return _mask(t, shape, rng, masked_row)
    if t.dtype == "bool":
        return rng.random(shape) < 0.5
    if t.dtype.startswith("int"):
        return rng.integers(0, 8, size=shape).astype(t.dtype)
    return sample(distribution, rng, shape, t.dtype)


def make_feeds(
    spec: ModelSpec, sizes: Mapping[str, int], seed: int, *, masked_row: bool = True, distribution: str = DEFAULT
) -> dict[str, np.ndarray]:
    """Feeds for every input of ``spec``, in declaration order, seeded by ``seed``; float
    inputs follow ``distribution`` (``spec.distributions``)."""
    rng = np.random.default_rng(seed)
    return {t.name: make_tensor(t, sizes, rng, masked_row=masked_row, distribution=distribution) for t in spec.inputs}
