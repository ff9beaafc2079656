"""Which tokens does a query see? Which padded rows of a self-attention key-padding mask see
no key depends on it: under a causal mask a left-padded prompt's rows before its first real
token see nothing; under a window, a padded row too far from every real token sees nothing;
in an encoder every padded row still sees every real token, and is a row like any other. So
PyTorch is asked once per model and query dim, on one set of inputs: with the key-padding
mask keeping no key, and then keeping one token's key alone, in turn; the rows whose output
differs between the two see that token. The farthest row before and after a token that
does is the module's ``Sight``. Asking with one key kept, not with every key, reads the
mask's reach and not the weights: a far key's weight among many can round to nothing,
while a row that sees only masked keys gives the same output whatever they hold. A short
probe asks every token; where its reach runs to the probe's end, a probe as long as the
longest case judged asks again of its first and last token, so that a window wider than the
short probe is still found. Build records the sight in each golden case, so that a golden
file is judged the same way without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from attn_export.artifacts.golden import Sight
from attn_export.errors import InputError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import validate_sizes
from attn_export.runtimes import Runtime

__all__ = ["query_dims", "sights"]

#: Query tokens the short probe runs with (fewer where the spec's range ends first), every one
#: of them asked in turn.
PROBE_TOKENS = 12
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


def _keeping(
    spec: ModelSpec, feeds: dict[str, np.ndarray], probe: Mapping[str, int], query: str, token: int | None
) -> dict[str, np.ndarray]:
    """``feeds`` with each key-padding mask over ``query``'s tokens keeping the key of
    ``token`` alone (None: no key), and every other mask keeping every key."""
    dims = query_dims(spec)
    out = dict(feeds)
    for t, mask in spec.masks:
        keep = np.ones(feeds[t.name].shape, dtype=bool)
        if dims.get(t.name) == query:
            parts = spec.dims[t.shape[1]].parts if t.shape[1] in spec.dims else ()
            keep[:] = False
            if token is not None:  # the query's tokens follow a sum's other parts (cached tokens)
                keep[:, sum(probe[p] for p in parts[:-1]) + token] = True
        out[t.name] = mask.convention.encode(keep, t.dtype)
    return out


def _reach(
    spec: ModelSpec, eager: Runtime, probe: Mapping[str, int], query: str, tokens: Iterable[int]
) -> tuple[int, int]:
    """How far before and after itself a row sees one of ``tokens``, at most: its output
    differs, however little, between no key kept and that token's key kept alone."""
    n = probe[query]
    feeds = make_feeds(spec, probe, _SEED)
    blind = eager.run(_keeping(spec, feeds, probe, query, None))
    before = after = 0
    for j in tokens:
        got = eager.run(_keeping(spec, feeds, probe, query, j))
        for o in spec.outputs:
            if query not in o.shape:
                continue
            axis = o.shape.index(query)
            for i in range(n):
                row = _along(axis, len(o.shape), i)
                if not np.array_equal(blind[o.name][row], got[o.name][row], equal_nan=True):
                    before, after = max(before, i - j), max(after, j - i)
    return before, after


def _sight_along(spec: ModelSpec, eager: Runtime, sizes: Mapping[str, int], query: str, longest: int) -> Sight:
    probe = _probe_sizes(spec, sizes, query, PROBE_TOKENS)
    n = probe[query]
    if n < 2:
        return Sight(None, None)  # one token sees all there is
    before, after = (None if r >= n - 1 else r for r in _reach(spec, eager, probe, query, range(n)))
    far = _probe_sizes(spec, sizes, query, longest)
    m = far[query]
    if m > n and None in (before, after):
        # the rows that see the first token say how far back a query sees; the last's, how far ahead
        ends = [j for j, unknown in ((0, before is None), (m - 1, after is None)) if unknown]
        farther = _reach(spec, eager, far, query, ends)
        if before is None and farther[0] < m - 1:
            before = farther[0]
        if after is None and farther[1] < m - 1:
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
