"""Masks as the module sees them: a layout (which axes are batch, heads, query and key), a
convention (how the module reads a value), a pattern (how verify fills it), and the named
cases that mask whole rows.

Patterns always leave every query row at least one key, so the ordinary sweep never holds a
fully masked row; those exist only in the named cases, where PyTorch and exporters are known
to disagree (``masking.py`` reports and repairs that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CASES",
    "CONVENTIONS",
    "LAYOUTS",
    "PATTERN",
    "PATTERNS",
    "Convention",
    "case_applies",
    "default_layout",
    "fill_mask",
    "keep_of",
    "masked_row_selector",
    "role_axis",
]

#: How verify fills a mask: keys kept at random, a kept prefix (right padding) or suffix
#: (left padding) per batch element, or keys up to the query's own position.
PATTERNS = ("random", "padding", "left-padding", "causal")
#: The ordinary case: the pattern alone, no fully masked row.
PATTERN = "pattern"
#: Named cases, each its own verify case: the last query row of the first batch element
#: masked entirely, and the first batch element masked entirely (a fully padded sequence).
CASES = ("fully-masked-row", "fully-padded-sequence")

#: Axis roles of each layout, in axis order. "heads" may be 1 (broadcast) or the head count.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "key-padding": ("batch", "key"),
    "query-key": ("query", "key"),
    "batch-query-key": ("batch", "query", "key"),
    "batch-heads-query-key": ("batch", "heads", "query", "key"),
}

_FLOATS = ("float32", "float16", "float64")
_INTS = ("int32", "int64")


def _additive(fill: Callable[[np.dtype], float]) -> Callable[[np.ndarray, str], np.ndarray]:
    def encode(keep: np.ndarray, dtype: str) -> np.ndarray:
        return np.where(keep, 0.0, fill(np.dtype(dtype))).astype(dtype)

    return encode


def _additive_keep(values: np.ndarray) -> np.ndarray:
    """Kept where the value is far above any masking fill (-inf or the dtype's minimum)."""
    return values > np.finfo(values.dtype).min / 2


@dataclass(frozen=True)
class Convention:
    """How a module reads a mask value: encode turns a keep-mask (True = attend) into the
    module's values, keep reads them back."""

    name: str
    dtypes: tuple[str, ...]
    help: str
    encode: Callable[[np.ndarray, str], np.ndarray]
    keep: Callable[[np.ndarray], np.ndarray]


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention(
            "attend",
            ("bool",),
            "True = attend, as F.scaled_dot_product_attention reads a bool mask",
            lambda k, d: k,
            lambda v: v,
        ),
        Convention(
            "ignore",
            ("bool",),
            "True = ignore, as nn.MultiheadAttention reads its masks",
            lambda k, d: ~k,
            lambda v: ~v.astype(bool),
        ),
        Convention(
            "additive",
            _FLOATS,
            "added to the scores: 0 = attend, -inf = ignore",
            _additive(lambda d: -np.inf),
            _additive_keep,
        ),
        Convention(
            "additive-min",
            _FLOATS,
            "added to the scores: 0 = attend, the dtype's minimum = ignore, as Hugging Face's 4-D masks",
            _additive(lambda d: float(np.finfo(d).min)),
            _additive_keep,
        ),
        Convention(
            "binary",
            _INTS,
            "1 = attend, 0 = ignore, as Hugging Face's attention_mask",
            lambda k, d: k.astype(d),
            lambda v: v != 0,
        ),
    )
}


def default_layout(shape: Sequence[int | str], batch_dim: int | str | None) -> str | None:
    """The layout a mask's rank implies; a 2-D mask is key padding when its first dim is the
    batch dim (the first dim of the first other input), else [query, key]."""
    rank = len(shape)
    if rank == 2:
        return "key-padding" if isinstance(shape[0], str) and shape[0] == batch_dim else "query-key"
    return {3: "batch-query-key", 4: "batch-heads-query-key"}.get(rank)


def role_axis(layout: str, role: str) -> int | None:
    roles = LAYOUTS[layout]
    return roles.index(role) if role in roles else None


def case_applies(case: str, layout: str, shape: Sequence[int | str]) -> bool:
    """A fully masked row needs a query axis of its own (not a broadcast 1)."""
    if case in (PATTERN, "fully-padded-sequence"):
        return True
    axis = role_axis(layout, "query")
    return axis is not None and shape[axis] != 1


def _keep3(pattern: str, b: int, q: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A [batch, query, key] keep-mask with at least one kept key in every row."""
    if pattern == "causal":
        return np.broadcast_to(np.tril(np.ones((q, k), dtype=bool)), (b, q, k)).copy()
    if pattern in ("padding", "left-padding"):
        keep = np.zeros((b, q, k), dtype=bool)
        for i in range(b):
            n = int(rng.integers(1, k + 1))
            keep[i, :, :n] = True
        return keep[..., ::-1].copy() if pattern == "left-padding" else keep
    keep = rng.random((b, q, k)) < 0.75
    empty = np.argwhere(~keep.any(axis=-1))
    keep[empty[:, 0], empty[:, 1], rng.integers(0, k, size=len(empty))] = True
    return keep


def fill_mask(
    pattern: str, convention: str, layout: str, dtype: str, shape: tuple[int, ...], rng: np.random.Generator, case: str
) -> np.ndarray:
    """A mask of ``shape`` in the module's convention: the pattern, then the named case."""
    roles = LAYOUTS[layout]
    size = {r: shape[i] for i, r in enumerate(roles)}
    keep = _keep3(pattern, size.get("batch", 1), size.get("query", 1), size["key"], rng)
    if case == "fully-masked-row":
        keep[0, -1, :] = False
    elif case == "fully-padded-sequence":
        keep[0] = False
    if "query" not in roles:
        keep = keep[:, 0]
    if "batch" not in roles:
        keep = keep[0]
    if "heads" in roles:
        keep = np.expand_dims(keep, roles.index("heads"))
    return CONVENTIONS[convention].encode(np.broadcast_to(keep, shape).copy(), dtype)


def keep_of(convention: str, values: np.ndarray) -> np.ndarray:
    """Which keys a mask lets each query attend (True = attend), whatever its convention."""
    return np.asarray(CONVENTIONS[convention].keep(values), dtype=bool)


def masked_row_selector(
    layout: str,
    mask_shape: Sequence[int | str],
    keep: np.ndarray,
    out_shape: Sequence[int | str],
    out_sizes: tuple[int, ...],
) -> np.ndarray:
    """The output elements that belong to fully masked rows, found by dim name: the mask's
    batch and query dims where the output has them; along a dim the output lacks, a row
    counts as fully masked when any is."""
    roles = LAYOUTS[layout]
    rows = np.logical_not(np.any(keep, axis=-1))
    if "heads" in roles:
        rows = np.any(rows, axis=roles.index("heads"))
    matched: list[int] = []  # the output axis of each remaining axis of ``rows``
    for role in (r for r in roles if r in ("batch", "query")):
        dim = mask_shape[roles.index(role)]
        hits = [i for i, d in enumerate(out_shape) if isinstance(dim, str) and d == dim]
        if hits:
            matched.append(hits[0])
        else:
            rows = np.any(rows, axis=len(matched))
    rows = np.transpose(rows, [int(i) for i in np.argsort(matched)]) if matched else rows
    shape = [out_sizes[i] if i in matched else 1 for i in range(len(out_sizes))]
    return np.broadcast_to(rows.reshape(shape), out_sizes)
