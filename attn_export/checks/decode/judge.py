"""Judge decode trajectories: each step of the graph against the expected side, and the
expected side against its own recompute, by the one pass rule (``compare.outputs``) with
each tolerance widened by PyTorch's own rounding, padded query rows left out where the spec
says so; each padded row alone against what the batch gave it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from attn_export.checks.cache_growth import cache_carry, cache_growth
from attn_export.checks.decode.plan import Feeds, Trajectory, axis_of, pass_length
from attn_export.checks.decode.results import DecodeStep
from attn_export.checks.decode.run import run_alone
from attn_export.compare import OutputComparison, compare_outputs
from attn_export.model_spec import ModelSpec, Rounding, Tolerance
from attn_export.model_spec.cache import CacheSpec
from attn_export.runtimes.base import Runtime

__all__ = ["compare_trajectories", "unpadded"]


def _newest(value: np.ndarray, axis: int, count: int) -> np.ndarray:
    """The last ``count`` positions on ``axis``: the newest ones a cache holds."""
    n = value.shape[axis]
    return np.take(value, range(n - count, n), axis=axis)


def _key_axis(spec: ModelSpec, cache: CacheSpec, name: str) -> int | None:
    """The axis of output ``name`` over cached and new positions: a present's axis 2, or
    an output's ``total_dim``."""
    return 2 if name in {p for _, p in cache.pairs} else axis_of(spec, name, cache.total_dim)


def unpadded(
    runtime: Runtime, spec: ModelSpec, traj: Trajectory, outputs: list[Feeds], tolerances: Mapping[str, Tolerance]
) -> list[OutputComparison]:
    """Each left-padded row's real tokens, alone and without padding, against what the
    batch gave them: padding must change nothing a real token sees (a mask the module
    ignores, reads inverted or takes from another row fails here)."""
    cache = traj.cache
    assert traj.tokens is not None and cache.batch_dim is not None, "only a planned, batched trajectory pads"
    found: list[OutputComparison] = []
    # the rows' outputs span every step: the largest float32 error PyTorch made on any
    floors = {t.name: max((f.get(t.name, 0.0) for f in traj.floors), default=0.0) for t in spec.outputs}
    for row, keep in enumerate(traj.keep):
        pad = int((~keep).sum())
        if not pad or keep.size - pad > spec.dims[cache.seq_dim].max:
            continue
        tokens = {}
        for name, value in traj.tokens.items():
            v = np.take(value, [row], axis=axis_of(spec, name, cache.batch_dim) or 0)
            a = axis_of(spec, name, cache.seq_dim)
            tokens[name] = v if a is None else np.take(v, range(pad, keep.size), axis=a)
        alone = run_alone(runtime, spec, cache, tokens, np.ones((1, keep.size - pad), dtype=bool))
        batched: Feeds = {}
        theirs: Feeds = {}
        for t in spec.outputs:
            b_axis = axis_of(spec, t.name, cache.batch_dim) or 0
            if (s_axis := axis_of(spec, t.name, cache.seq_dim)) is not None:
                whole = np.concatenate(
                    [np.take(o[t.name], [row], axis=b_axis) for o in outputs[: len(traj.steps)]], axis=s_axis
                )
                batched[t.name] = np.take(whole, range(pad, whole.shape[s_axis]), axis=s_axis)
                theirs[t.name] = alone[t.name]
            elif (p_axis := _key_axis(spec, cache, t.name)) is not None:
                # the real positions both still hold: every one, unless a window dropped some
                last = np.take(outputs[-1][t.name], [row], axis=b_axis)
                count = min(keep.size - pad, last.shape[p_axis], alone[t.name].shape[p_axis])
                batched[t.name] = _newest(last, p_axis, count)
                theirs[t.name] = _newest(alone[t.name], p_axis, count)
        found += [
            dataclasses.replace(c, name=f"{c.name} (row {row})")
            for c in compare_outputs(batched, theirs, tolerances, floors)
        ]
    return found


def _padded_rows(spec: ModelSpec, cache: CacheSpec, query_keep: np.ndarray) -> dict[str, np.ndarray]:
    """Per output with [batch, ..., seq, ...] axes: True at the rows of padded queries."""
    presents = {present for _, present in cache.pairs}
    out = {}
    for t in spec.outputs:
        if t.name in presents or cache.seq_dim not in t.shape or cache.batch_dim not in t.shape:
            continue
        axis, batch_axis = t.shape.index(cache.seq_dim), t.shape.index(cache.batch_dim)
        shape = [1] * len(t.shape)
        shape[batch_axis], shape[axis] = query_keep.shape
        ordered = query_keep if batch_axis < axis else query_keep.T
        out[t.name] = ~ordered.reshape(shape)
    return out


def _padded_positions(spec: ModelSpec, cache: CacheSpec, keep: np.ndarray, values: Feeds) -> dict[str, np.ndarray]:
    """Per present: True at the positions of padding tokens (``keep``: every token so far, a
    present the newest of them). A padding token's key and value from the second layer on are
    computed from its query row at the layer before, which ``fully_masked = "ignore"`` leaves
    out: a 2-layer Llama left-padded gave them 0.24 apart, a graph as right as PyTorch."""
    out = {}
    for _, name in cache.pairs:
        t = next((o for o in spec.outputs if o.name == name), None)
        if t is None or name not in values or cache.total_dim not in t.shape or cache.batch_dim not in t.shape:
            continue
        axis, batch_axis = t.shape.index(cache.total_dim), t.shape.index(cache.batch_dim)
        newest = keep[:, keep.shape[1] - values[name].shape[axis] :]
        shape = [1] * len(t.shape)
        shape[batch_axis], shape[axis] = newest.shape
        out[name] = ~(newest if batch_axis < axis else newest.T).reshape(shape)
    return out


def _compare(
    expected: Feeds,
    actual: Feeds,
    tolerances: Mapping[str, Tolerance],
    blank: Mapping[str, np.ndarray],
    floors: Mapping[str, float],
    int8: Mapping[str, Rounding] | None = None,
) -> list[OutputComparison]:
    """compare_outputs (tolerances widened by ``floors`` and, for int8, ``int8``), with the
    rows in ``blank`` set to 0 on both sides (not compared)."""

    def cleared(values: Feeds) -> Feeds:
        out = dict(values)
        for name, rows in blank.items():
            if name in out and out[name].ndim == rows.ndim:
                out[name] = np.where(np.broadcast_to(rows, out[name].shape), 0, out[name]).astype(out[name].dtype)
        return out

    left_out = {
        n: np.broadcast_to(rows, expected[n].shape)
        for n, rows in blank.items()
        if n in expected and expected[n].ndim == rows.ndim
    }
    return compare_outputs(cleared(expected), cleared(actual), tolerances, floors, left_out, int8)


def compare_trajectories(
    spec: ModelSpec,
    traj: Trajectory,
    expected: list[Feeds],
    actual: list[Feeds],
    tolerances: Mapping[str, Tolerance],
    actual_error: str | None,
    recomputed: Feeds | None = None,
) -> list[DecodeStep]:
    """Per step: the graph's outputs and presents against the expected side's (padded
    query rows left out under ``fully_masked = "ignore"``), and the expected side's
    against recompute (real tokens only: a padded query has nothing to agree on, nor the
    keys and values later layers compute from one)."""
    cache = traj.cache
    presents = {present for _, present in cache.pairs}
    # the rows of the one pass that each step's outputs hold: its own tokens of a per-token
    # output, every token so far of a present (the newest, with a window); an output without
    # either is not compared
    rows: dict[str, tuple[int, bool]] = {}
    for t in spec.outputs:
        whole = t.name in presents
        axis = axis_of(spec, t.name, cache.total_dim if whole else cache.seq_dim)
        if axis is not None:
            rows[t.name] = (axis, whole)
    length = pass_length(spec, traj) if recomputed is not None else 0
    steps = []
    for k, sizes in enumerate(traj.sizes[: len(expected)]):
        past, seq = sizes[cache.past_dim], sizes[cache.seq_dim]
        start, stop = traj.span(k)
        padded = _padded_rows(spec, cache, traj.keep[:, start:stop])
        graph = actual[k] if k < len(actual) else None
        step = DecodeStep(k + 1, past, seq, start=start)
        step.growth = cache_growth(spec, cache, sizes, graph, expected[k])
        if graph is not None and k > 0:
            pasts = [{past: side[k - 1][present] for past, present in cache.pairs} for side in (actual, expected)]
            step.carry = cache_carry(cache, sizes, (pasts[0], graph), (pasts[1], expected[k]))
        floors = traj.floors[k] if k < len(traj.floors) else {}
        if graph is not None:
            int8 = traj.int8[k] if k < len(traj.int8) else {}
            ignored = spec.fully_masked == "ignore"
            blank = {**padded, **_padded_positions(spec, cache, traj.keep[:, :stop], expected[k])} if ignored else {}
            step.comparisons = _compare(expected[k], graph, tolerances, blank, floors, int8)
        else:
            step.error = actual_error or "the graph produced no output"
        if recomputed is not None and stop <= length:
            mine: Feeds = {}
            theirs: Feeds = {}
            for n, (a, whole) in rows.items():
                if not whole:
                    mine[n], theirs[n] = np.take(recomputed[n], range(start, stop), axis=a), expected[k][n]
                    continue
                # the positions both hold: the step's present ends at stop, the pass's at length
                offset = length - recomputed[n].shape[a]
                lo = max(stop - expected[k][n].shape[a], offset, 0)
                if lo < stop:
                    mine[n] = np.take(recomputed[n], range(lo - offset, stop - offset), axis=a)
                    theirs[n] = _newest(expected[k][n], a, stop - lo)
            # a padding token's key and value from the second layer on come from a query row
            # that sees no key, which the module gives as the pass's length makes it
            pads = _padded_positions(spec, cache, traj.keep[:, :stop], theirs)
            step.recompute = _compare(mine, theirs, tolerances, {**padded, **pads}, floors)
        steps.append(step)
        if step.error:
            break
    return steps
