"""Does a query see the tokens after it? Which padded rows of a self-attention key-padding
mask see no key depends on it: under a causal mask a left-padded prompt's rows before its
first real token see nothing, while in an encoder every padded row still sees every real
token, and is a row like any other. So PyTorch is asked once per model: with every token
kept, the last token's inputs change; do the rows before it change? Build records the
answer in each golden case, so that a golden file is judged the same way without torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attn_export.compare import compare_output
from attn_export.runtimes import Runtime
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds

__all__ = ["query_dims", "sees_later_tokens"]

#: Other seeds tried for the last token's inputs until they differ from the first.
_TRIES = 8


def query_dims(spec: ModelSpec) -> dict[str, str]:
    """Per self-attention key-padding mask (by input name), the dim of its query rows: the
    key dim itself, or the last part of a sum (``total_seq = "past_seq + seq"``: the new
    tokens follow the cached ones), where some output has it. A mask over keys that no
    output has rows of (cross-attention) marks no query."""
    out = {}
    for t, mask in spec.masks:
        if mask.layout != "key-padding" or not isinstance(t.shape[1], str):
            continue
        key = t.shape[1]
        parts = spec.dims[key].parts if key in spec.dims else ()
        query = parts[-1] if parts else key
        if any(query in o.shape for o in spec.outputs):
            out[t.name] = query
    return out


def _along(axis: int, ndim: int, pick: int | slice) -> tuple[int | slice, ...]:
    return tuple(pick if i == axis else slice(None) for i in range(ndim))


def sees_later_tokens(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], seed: int = 0) -> bool:
    """True where changing the last token's inputs (token ids as well as vectors) changes an
    output row before it, with every token of every key-padding mask kept; False where no
    row could show it (no such mask, or one token at most)."""
    dims = query_dims(spec)
    if not dims:
        return False
    query = next(iter(dims.values()))
    sizes = dict(sizes)
    if sizes[query] < 2:
        if spec.dims[query].max < 2:
            return False
        sizes[query] = 2
    sizes = spec.with_sums(sizes)
    feeds = make_feeds(spec, sizes, seed)
    for t, mask in spec.masks:
        if t.name in dims:
            feeds[t.name] = mask.convention.encode(np.ones(feeds[t.name].shape, dtype=bool), t.dtype)
    changed = dict(feeds)
    for u in spec.inputs:
        if u.mask is not None or query not in u.shape:
            continue
        last = _along(u.shape.index(query), len(u.shape), -1)
        for other in range(seed + 1, seed + 1 + _TRIES):  # token ids from a small vocabulary may draw the same
            value = feeds[u.name].copy()
            value[last] = make_feeds(spec, sizes, other)[u.name][last]
            if not np.array_equal(value, feeds[u.name]):
                changed[u.name] = value
                break
    before, after = eager.run(feeds), eager.run(changed)
    for o in spec.outputs:
        if query not in o.shape:
            continue
        earlier = _along(o.shape.index(query), len(o.shape), slice(0, -1))
        moved = compare_output(o.name, before[o.name][earlier], after[o.name][earlier], spec.tolerance_for(o.name))
        if not moved.passed:
            return True
    return False
