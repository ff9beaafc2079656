"""Masks as the module sees them: a layout (which axes are batch, heads, query and key), a
convention (how the module reads a value), a pattern (how verify fills it), and the named
cases that mask whole rows.

Each mask input carries a ``MaskSpec``: its pattern, its layout and its ``Convention``, a
record that encodes, reads back and fills values the module's way.

Patterns always leave every query row at least one key, so the ordinary sweep never holds a
fully masked row; those exist only in the named cases, where PyTorch and exporters are known
to disagree (``checks.fully_masked`` reports and repairs that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CASES",
    "CONVENTIONS",
    "EXPANSIONS",
    "FULL",
    "LAYOUTS",
    "PATTERN",
    "PATTERNS",
    "Convention",
    "MaskSpec",
    "case_applies",
    "default_layout",
    "fill_mask",
    "masked_row_selector",
    "role_axis",
]

#: How verify fills a mask: keys kept at random, a kept prefix (right padding) or suffix
#: (left padding) per batch element, keys up to the query's own position, or every key (a
#: graph that takes no padding where the cache holds tokens: onnxruntime-genai's model
#: builder's, whose attention counts a row's real tokens as a prefix of the whole).
PATTERNS = ("random", "padding", "left-padding", "causal", "full")
#: The pattern that keeps every key: no named case applies, nothing hidden to probe.
FULL = "full"
#: The ordinary case: the pattern alone, no fully masked row.
PATTERN = "pattern"
#: Named cases, each its own verify case: the last query row of the first batch element
#: masked entirely, and the first batch element masked entirely (a fully padded sequence).
CASES = ("fully-masked-row", "fully-padded-sequence")

#: How an adapter turns a tokenizer's 2-D mask (``[batch, seq]``, 1 = attend) into the mask
#: a Hugging Face attention layer takes, as its model class does before calling it: the
#: transformers function that the model class calls, by name. It is called with the spec's
#: config, the first floating input as ``inputs_embeds``, the mask, and no cache.
EXPANSIONS: dict[str, str] = {
    "bidirectional": "transformers.masking_utils:create_bidirectional_mask",
    "causal": "transformers.masking_utils:create_causal_mask",
    "sliding-window": "transformers.masking_utils:create_sliding_window_causal_mask",
}

#: Axis roles of each layout, in axis order. "heads" may be 1 (broadcast) or the head count.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "key-padding": ("batch", "key"),
    "query-key": ("query", "key"),
    "batch-query-key": ("batch", "query", "key"),
    "batch-heads-query-key": ("batch", "heads", "query", "key"),
}

_FLOATS = ("float32", "float16", "float64")
_INTS = ("int32", "int64")


def _additive_keep(values: np.ndarray) -> np.ndarray:
    """Kept where the value is far above any masking fill (-inf or the dtype's minimum)."""
    return values > np.finfo(values.dtype).min / 2


@dataclass(frozen=True)
class Convention:
    """How a module reads a mask value: ``encode`` turns a keep-mask (True = attend) into
    the module's values, ``keep`` reads them back. An additive convention has a ``fill``,
    the value that hides a key (-inf, or the dtype's minimum), added to the scores."""

    name: str
    dtypes: tuple[str, ...]
    help: str
    read: Callable[[np.ndarray], np.ndarray]
    #: For additive conventions: the value that hides a key, for a dtype.
    fill: Callable[[np.dtype], float] | None = None
    #: For the others: the keep-mask in the module's values (additive ones add 0 or ``fill``).
    write: Callable[[np.ndarray, str], np.ndarray] | None = None

    def encode(self, keep: np.ndarray, dtype: str) -> np.ndarray:
        """A keep-mask (True = attend) as the module's values of ``dtype``."""
        if self.fill is not None:
            return np.where(keep, 0.0, self.fill(np.dtype(dtype))).astype(dtype)
        assert self.write is not None, f"convention {self.name} has neither fill nor write"
        return self.write(keep, dtype)

    def keep(self, values: np.ndarray) -> np.ndarray:
        """Which keys ``values`` let each query attend (True = attend)."""
        return np.asarray(self.read(values), dtype=bool)

    @property
    def infinite_fill(self) -> bool:
        """Whether the fill is -inf: a value no other float input may hold."""
        return self.fill is not None and bool(np.isinf(self.fill(np.dtype("float32"))))

    def admits(self, values: np.ndarray) -> bool:
        """No NaN or Inf in float ``values`` except the convention's own fill (-inf)."""
        finite = np.where(values == -np.inf, 0, values) if self.infinite_fill else values
        return bool(np.isfinite(finite).all())

    def __reduce__(self) -> tuple[Callable[[str], Convention], tuple[str]]:
        """Pickled by name (its functions are the registry's): a spec crosses to the
        processes of ``--jobs`` and to Ray workers."""
        return _convention, (self.name,)


def _convention(name: str) -> Convention:
    return CONVENTIONS[name]


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention(
            "attend",
            ("bool",),
            "True = attend, as F.scaled_dot_product_attention reads a bool mask",
            read=lambda v: v,
            write=lambda k, d: k,
        ),
        Convention(
            "ignore",
            ("bool",),
            "True = ignore, as nn.MultiheadAttention reads its masks",
            read=lambda v: ~v.astype(bool),
            write=lambda k, d: ~k,
        ),
        Convention(
            "additive",
            _FLOATS,
            "added to the scores: 0 = attend, -inf = ignore",
            read=_additive_keep,
            fill=lambda d: -np.inf,
        ),
        Convention(
            "additive-min",
            _FLOATS,
            "added to the scores: 0 = attend, the dtype's minimum = ignore, as Hugging Face's 4-D masks",
            read=_additive_keep,
            fill=lambda d: float(np.finfo(d).min),
        ),
        Convention(
            "binary",
            _INTS,
            "1 = attend, 0 = ignore, as Hugging Face's attention_mask",
            read=lambda v: v != 0,
            write=lambda k, d: k.astype(d),
        ),
    )
}


def default_layout(
    shape: Sequence[int | str], others: Sequence[Sequence[int | str]], pattern: str | None = None
) -> str | None:
    """The layout a mask's rank implies, given the shapes of the other inputs. A 2-D mask
    ``[a, b]`` is key padding when ``a`` is the batch dim: beside the key dim ``b`` in the
    two leading axes of the inputs that lead with ``b`` (``[batch, kv_seq, embed]`` or
    seq-first ``[kv_seq, batch, embed]``; not a bias ``[batch, heads, seq, kv_seq]``), or,
    where no input leads with ``b`` (a sum dim), the first dim of the first input; else
    ``[query, key]``. A batch of one sequence (``[1, kv_seq]`` beside ``[1, kv_seq, embed]``)
    is key padding too, but for a ``causal`` pattern, which needs its query axis: read as
    one query row broadcast, it would mask the same keys, but its padded query rows would
    go unseen."""
    rank = len(shape)
    if rank == 2:
        a, b = shape
        holding = [s[:2] for s in others if b in s[:2]]
        first = others[0][0] if others and others[0] else None
        batch = a != b and any(a in s for s in holding) if holding else a == first
        one = a == 1 and pattern != "causal"
        return "key-padding" if (isinstance(a, str) or one) and batch else "query-key"
    return {3: "batch-query-key", 4: "batch-heads-query-key"}.get(rank)


def role_axis(layout: str, role: str) -> int | None:
    roles = LAYOUTS[layout]
    return roles.index(role) if role in roles else None


def case_applies(case: str, layout: str, shape: Sequence[int | str]) -> bool:
    """A fully masked row needs a query axis of its own (not a broadcast 1); a fully padded
    sequence, a batch axis of its own: without one it pads every sequence, and under
    ``fully_masked = "ignore"`` the case would compare nothing and still pass."""
    if case == PATTERN:
        return True
    axis = role_axis(layout, "query" if case == "fully-masked-row" else "batch")
    return axis is not None and shape[axis] != 1


def _keep3(pattern: str, b: int, q: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A [batch, query, key] keep-mask with at least one kept key in every row, and rows at
    both extremes: padding of two or more sequences keeps the last whole (a graph dropping
    its oldest keys showed only at lengths that random draws rarely reach) and one key of
    the first, as the first query row of a random mask keeps one key (where every kept
    score is far below a graph's mask fill, as at large values, masked keys take the
    weight: a fill of -1e4 for -1e9 passed rows keeping three keys in four), or, where
    the mask has no query axis of its own, its first sequence's row."""
    if pattern == FULL:
        return np.ones((b, q, k), dtype=bool)
    if pattern == "causal":
        return np.broadcast_to(np.tril(np.ones((q, k), dtype=bool)), (b, q, k)).copy()
    if pattern in ("padding", "left-padding"):
        keep = np.zeros((b, q, k), dtype=bool)
        for i in range(b):
            n = k if i == b - 1 > 0 else 1 if i == 0 < b - 1 else int(rng.integers(1, k + 1))
            keep[i, :, :n] = True
        return keep[..., ::-1].copy() if pattern == "left-padding" else keep
    keep = rng.random((b, q, k)) < 0.75
    if q > 1:  # the first query row of each sequence
        keep[:, 0] = False
        keep[np.arange(b), 0, rng.integers(0, k, size=b)] = True
    elif b > 1:  # a mask without a query axis of its own: the first sequence's row
        keep[0] = False
        keep[0, :, rng.integers(0, k)] = True
    empty = np.argwhere(~keep.any(axis=-1))
    keep[empty[:, 0], empty[:, 1], rng.integers(0, k, size=len(empty))] = True
    return keep


@dataclass(frozen=True)
class MaskSpec:
    """A mask input as the module sees it: how verify fills it (``pattern``), which axes
    are batch, heads, query and key (``layout``), and how the module reads a value."""

    pattern: str
    layout: str
    convention: Convention

    def keep(self, values: np.ndarray) -> np.ndarray:
        """Which keys the mask lets each query attend (True = attend)."""
        return self.convention.keep(values)

    def axis(self, role: str) -> int | None:
        """The axis of ``role`` (batch, heads, query, key), None where the layout has none."""
        return role_axis(self.layout, role)

    def to_dict(self) -> dict[str, str]:
        """The spec file's keys: ``mask`` (the pattern), ``convention``, ``layout``."""
        return {"mask": self.pattern, "convention": self.convention.name, "layout": self.layout}


def fill_mask(mask: MaskSpec, dtype: str, shape: tuple[int, ...], rng: np.random.Generator, case: str) -> np.ndarray:
    """A mask of ``shape`` in the module's convention: the pattern, then the named case
    where it applies to this mask (``case_applies``)."""
    roles = LAYOUTS[mask.layout]
    size = {r: shape[i] for i, r in enumerate(roles)}
    keep = _keep3(mask.pattern, size.get("batch", 1), size.get("query", 1), size["key"], rng)
    # a [seq, seq] mask beside a key-padding one keeps its pattern, as a full one does
    applies = mask.pattern != FULL and case_applies(case, mask.layout, shape)
    if case == "fully-masked-row" and applies:
        keep[0, -1, :] = False
    elif case == "fully-padded-sequence" and applies:
        keep[0] = False
    if "query" not in roles:
        keep = keep[:, 0]
    if "batch" not in roles:
        keep = keep[0]
    if "heads" in roles:
        keep = np.expand_dims(keep, roles.index("heads"))
    return mask.convention.encode(np.broadcast_to(keep, shape).copy(), dtype)


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
