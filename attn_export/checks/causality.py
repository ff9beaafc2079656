"""Which tokens does a query see? Which padded rows of a self-attention key-padding mask see
no key depends on it: under a causal mask a left-padded prompt's rows before its first real
token see nothing; under a window, a padded row too far from every real token sees nothing;
in an encoder every padded row still sees every real token, and is a row like any other. So
PyTorch is asked once per model and query dim: with every key kept, each token's inputs
change in turn; which rows change with it? The farthest row before and after a token that
does is the module's ``Sight``. A short probe asks every token; where its reach runs to the
probe's end, a probe as long as the longest case judged asks again from its first and last
token, so that a window wider than the short probe is still found. Build records the sight
in each golden case, so that a golden file is judged the same way without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from attn_export.artifacts.golden import Sight
from attn_export.errors import InputError
from attn_export.runtimes import Runtime
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds
from attn_export.spec.shapes import validate_sizes

__all__ = ["query_dims", "sights"]

#: Query tokens the short probe runs with (fewer where the spec's range ends first), every one
#: of them changed in turn.
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


def _probe_sizes(spec: ModelSpec, sizes: Mapping[str, int], query: str, tokens: int) -> dict[str, int]:
    """``sizes`` with ``tokens`` query tokens where the spec's ranges allow it."""
    wanted = spec.with_sums({**sizes, query: min(spec.dims[query].max, max(tokens, sizes[query]))})
    try:
        validate_sizes(spec, wanted)
        return wanted
    except InputError:
        return spec.with_sums(sizes)


def _changed_at(
    spec: ModelSpec,
    feeds: dict[str, np.ndarray],
    other: Callable[[int], dict[str, np.ndarray]],
    query: str,
    j: int,
) -> dict[str, np.ndarray] | None:
    """``feeds`` with every input of token ``j`` (ids as well as vectors) taken from the first
    of the feeds of other seeds (``other(k)``, ``k < _TRIES``) that changes it; None where
    nothing carries the token."""
    changed = dict(feeds)
    for u in spec.inputs:
        if u.mask is not None or query not in u.shape:
            continue
        at = _along(u.shape.index(query), len(u.shape), j)
        for k in range(_TRIES):  # ids from a small vocabulary may draw the same
            value = feeds[u.name].copy()
            value[at] = other(k)[u.name][at]
            if not np.array_equal(value, feeds[u.name]):
                changed[u.name] = value
                break
    return None if all(changed[n] is feeds[n] for n in feeds) else changed


def _reach(
    spec: ModelSpec, eager: Runtime, probe: Mapping[str, int], query: str, tokens: Iterable[int]
) -> tuple[int, int] | None:
    """How far before and after itself a row changes when one of ``tokens`` does, at most;
    None where a token has nothing to change. A row changes on any difference, however
    small: a far token's weight in a row can fall below any tolerance, while a key the
    module masks adds exactly nothing."""
    n = probe[query]
    feeds = make_feeds(spec, probe, _SEED)
    for t, mask in spec.masks:  # the module's own masking alone
        feeds[t.name] = mask.convention.encode(np.ones(feeds[t.name].shape, dtype=bool), t.dtype)
    base = eager.run(feeds)
    made: dict[int, dict[str, np.ndarray]] = {}

    def other(k: int) -> dict[str, np.ndarray]:  # made only when needed: a long probe's feeds are large
        if k not in made:
            made[k] = make_feeds(spec, probe, _SEED + 1 + k)
        return made[k]

    before = after = 0
    for j in tokens:
        changed = _changed_at(spec, feeds, other, query, j)
        if changed is None:
            return None
        got = eager.run(changed)
        for o in spec.outputs:
            if query not in o.shape:
                continue
            axis = o.shape.index(query)
            for i in range(n):
                row = _along(axis, len(o.shape), i)
                if not np.array_equal(base[o.name][row], got[o.name][row], equal_nan=True):
                    before, after = max(before, i - j), max(after, j - i)
    return before, after


def _sight_along(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], query: str, longest: int) -> Sight:
    probe = _probe_sizes(spec, sizes, query, PROBE_TOKENS)
    n = probe[query]
    if n < 2:
        return Sight(None, None)  # one token sees all there is
    reach = _reach(spec, eager, probe, query, range(n))
    if reach is None:
        return Sight(None, None)  # nothing to change: judged as seeing every position
    before, after = (None if r >= n - 1 else r for r in reach)
    if longest > n and None in (before, after):
        far = _probe_sizes(spec, sizes, query, longest)
        m = far[query]
        # the rows the first token changes say how far back a query sees; the last's, how far ahead
        ends = [j for j, unknown in ((0, before is None), (m - 1, after is None)) if unknown]
        farther = _reach(spec, eager, far, query, ends) if m > n else None
        if farther is not None and before is None and farther[0] < m - 1:
            before = farther[0]
        if farther is not None and after is None and farther[1] < m - 1:
            after = farther[1]
    return Sight(before, after)


def sights(
    spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], judged: Iterable[Mapping[str, int]] = ()
) -> dict[str, Sight]:
    """Per self-attention key-padding mask, the module's ``Sight`` along its query dim: for
    each token, which rows change when its inputs do, with every mask keeping every key;
    measured as far as the longest of the ``judged`` cases' sizes reaches, since a window
    wider than the probe reads as none."""
    judged = list(judged)
    found: dict[str, Sight] = {}
    out = {}
    for name, query in query_dims(spec).items():
        if query not in found:
            longest = max((case[query] for case in judged if query in case), default=0)
            found[query] = _sight_along(spec, eager, sizes, query, longest)
        out[name] = found[query]
    return out
