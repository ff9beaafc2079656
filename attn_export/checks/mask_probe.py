"""Does the module read each mask the way its spec says? A spec whose convention or layout
is wrong still builds and verifies (PyTorch and the graph get the same wrong masks), but
every named case then tests something else. So build asks PyTorch: keys a mask hides from
a row must not change that row. It gives new values to those keys in every input that
carries them, reruns the module, and compares the row.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attn_export.compare import compare_output
from attn_export.errors import SpecError
from attn_export.model_spec import ModelSpec, TensorSpec
from attn_export.model_spec.cache import output_shape
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.masks import FULL, LAYOUTS, MaskSpec
from attn_export.runtimes import Runtime
from attn_export.runtimes.torch_eager import same_answer

__all__ = ["check_masks"]

#: Seeds tried until a row hides some keys and keeps others (needed to probe anything).
_TRIES = 8


def _dim(t: TensorSpec, mask: MaskSpec, role: str) -> int | str | None:
    axis = mask.axis(role)
    return None if axis is None else t.shape[axis]


def _by_row(mask: MaskSpec, values: np.ndarray) -> np.ndarray:
    """The keep-mask as [batch, query, key] (1 where the layout lacks an axis), any head."""
    roles = LAYOUTS[mask.layout]
    keep = mask.keep(values)
    if "heads" in roles:
        keep = np.any(keep, axis=roles.index("heads"))
    if "query" not in roles:
        keep = keep[..., None, :]
    return keep if "batch" in roles else keep[None]


def _row(t: TensorSpec, mask: MaskSpec, keep: np.ndarray) -> tuple[int, int, np.ndarray] | None:
    """A (batch, query) row that hides some keys and keeps others; in self-attention (one
    dim for queries and keys) the query's own position must be kept, as it is perturbed."""
    self_attention = _dim(t, mask, "query") == _dim(t, mask, "key")
    for b in range(keep.shape[0]):
        for q in range(keep.shape[1]):
            hidden = ~keep[b, q]
            if hidden.any() and not hidden.all() and not (self_attention and hidden[q]):
                return b, q, hidden
    return None


def _at(shape: tuple[int | str, ...], sizes: tuple[int, ...], picks: Mapping[int | str | None, object]) -> tuple:
    """An index into a tensor of ``shape`` taking ``picks[dim]`` along each axis named ``dim``."""
    index: list[object] = [slice(None)] * len(sizes)
    for dim, pick in picks.items():
        if isinstance(dim, str) and dim in shape:
            index[shape.index(dim)] = pick
    return tuple(index)


def _probe_one(
    spec: ModelSpec, t: TensorSpec, mask: MaskSpec, eager: Runtime, sizes: Mapping[str, int], seed: int
) -> None:
    for attempt in range(_TRIES):
        feeds = make_feeds(spec, sizes, seed + attempt)
        found = _row(t, mask, _by_row(mask, feeds[t.name]))
        if found is not None:
            break
    else:
        return  # every row keeps all its keys or none at these sizes: nothing to probe
    b, q, hidden = found
    batch, query, key = (_dim(t, mask, role) for role in ("batch", "query", "key"))
    positions = np.flatnonzero(hidden)
    rng = np.random.default_rng(seed)
    changed = dict(feeds)
    for u in spec.inputs:
        if u.mask is None and u.dtype.startswith("float") and key in u.shape:
            value = feeds[u.name].copy()
            index = _at(u.shape, value.shape, {batch: b, key: positions})
            value[index] = 3 * rng.standard_normal(value[index].shape).astype(value.dtype)
            changed[u.name] = value
    if all(changed[n] is feeds[n] for n in feeds):
        return  # no input carries the keys: nothing to perturb
    before, after = eager.run(feeds), eager.run(changed)
    same_answer(before, eager.run(feeds))  # a module random in eval changes every row: not the mask's doing
    kept = np.flatnonzero(~hidden)
    for o in spec.outputs:
        out_sizes = output_shape(spec, o, sizes)
        index = _at(o.shape, out_sizes, {batch: b, key: kept, query: q})
        result = compare_output(o.name, before[o.name][index], after[o.name][index], spec.tolerance_for(o.name))
        if not result.passed:
            convention = mask.convention
            row = f"batch {b}" + (f", query {q}" if query is not None else "")
            raise SpecError(
                f"{spec.name}: mask '{t.name}' read as '{convention.name}' ({convention.help}; layout {mask.layout}): "
                f"keys it hides from the row at {row} still change output '{o.name}' there "
                f"(max abs {result.max_abs_error:.3g}); the module reads the mask another way: check its "
                "'convention' and 'layout'"
            )


def check_masks(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], seed: int = 0) -> None:
    """SpecError when a mask's hidden keys still change the rows they are hidden from (a
    mask that keeps every key hides none)."""
    for t, mask in spec.masks:
        if mask.pattern != FULL:
            _probe_one(spec, t, mask, eager, sizes, seed)
