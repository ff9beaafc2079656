"""Which tokens does a query see? Which padded rows of a self-attention key-padding mask see
no key depends on it: under a causal mask a left-padded prompt's rows before its first real
token see nothing; under a window, a padded row too far from every real token sees nothing;
in an encoder every padded row still sees every real token, and is a row like any other. So
PyTorch is asked once per model and query dim: with every key kept, each token's inputs
change in turn; which rows change with it? The farthest row before and after a token that
does is the module's ``Sight``. Build records it in each golden case, so that a golden file
is judged the same way without torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attn_export.artifacts.golden import Sight
from attn_export.compare import compare_output
from attn_export.errors import InputError
from attn_export.runtimes import Runtime
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds
from attn_export.spec.shapes import validate_sizes

__all__ = ["query_dims", "sights"]

#: Query tokens the probe runs with (fewer where the spec's range ends first): a window up to
#: this wide is found, a wider one reads as none, so its far rows are compared.
PROBE_TOKENS = 12
#: Other seeds tried for a token's inputs until they differ from the first.
_TRIES = 8
#: The probe's feeds: one seed, so that build, verify and localize find the same.
_SEED = 0


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


def _probe_sizes(spec: ModelSpec, sizes: Mapping[str, int], query: str) -> dict[str, int]:
    """``sizes`` with ``PROBE_TOKENS`` query tokens where the spec's ranges allow it."""
    wanted = spec.with_sums({**sizes, query: min(spec.dims[query].max, max(PROBE_TOKENS, sizes[query]))})
    try:
        validate_sizes(spec, wanted)
        return wanted
    except InputError:
        return spec.with_sums(sizes)


def _changed_at(
    spec: ModelSpec, feeds: dict[str, np.ndarray], others: list[dict[str, np.ndarray]], query: str, j: int
) -> dict[str, np.ndarray] | None:
    """``feeds`` with every input of token ``j`` (ids as well as vectors) taken from the first
    of ``others`` (feeds of other seeds) that changes it; None where nothing carries the token."""
    changed = dict(feeds)
    for u in spec.inputs:
        if u.mask is not None or query not in u.shape:
            continue
        at = _along(u.shape.index(query), len(u.shape), j)
        for other in others:  # ids from a small vocabulary may draw the same
            value = feeds[u.name].copy()
            value[at] = other[u.name][at]
            if not np.array_equal(value, feeds[u.name]):
                changed[u.name] = value
                break
    return None if all(changed[n] is feeds[n] for n in feeds) else changed


def _sight_along(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], query: str) -> Sight:
    probe = _probe_sizes(spec, sizes, query)
    n = probe[query]
    if n < 2:
        return Sight(None, None)  # one token sees all there is
    feeds = make_feeds(spec, probe, _SEED)
    for t, mask in spec.masks:  # the module's own masking alone
        feeds[t.name] = mask.convention.encode(np.ones(feeds[t.name].shape, dtype=bool), t.dtype)
    base = eager.run(feeds)
    others = [make_feeds(spec, probe, seed) for seed in range(_SEED + 1, _SEED + 1 + _TRIES)]
    before = after = 0
    for j in range(n):
        changed = _changed_at(spec, feeds, others, query, j)
        if changed is None:
            return Sight(None, None)  # nothing to change: judged as seeing every position
        got = eager.run(changed)
        for o in spec.outputs:
            if query not in o.shape:
                continue
            axis = o.shape.index(query)
            for i in range(n):
                row = _along(axis, len(o.shape), i)
                if not compare_output(o.name, base[o.name][row], got[o.name][row], spec.tolerance_for(o.name)).passed:
                    before, after = max(before, i - j), max(after, j - i)
    return Sight(None if before >= n - 1 else before, None if after >= n - 1 else after)


def sights(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int]) -> dict[str, Sight]:
    """Per self-attention key-padding mask, the module's ``Sight`` along its query dim: for
    each token, which rows change when its inputs do, with every mask keeping every key."""
    found: dict[str, Sight] = {}
    out = {}
    for name, query in query_dims(spec).items():
        if query not in found:
            found[query] = _sight_along(spec, eager, sizes, query)
        out[name] = found[query]
    return out
