"""Run decode trajectories: each side, PyTorch or a graph's runtime, steps through a
trajectory feeding back its own presents as its pasts; PyTorch also runs the whole
trajectory without a cache, in one pass, and each padded row alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attn_export.checks.cache_growth import cache_growth
from attn_export.checks.decode.plan import (
    Feeds,
    Trajectory,
    alone_feeds,
    empty_pasts,
    layouts,
    one_pass_feeds,
    pass_length,
    plan_trajectory,
    step_inputs,
)
from attn_export.errors import AttnExportError, GraphCheckError
from attn_export.model_spec import ModelSpec, Rounding
from attn_export.model_spec.cache import CacheSpec
from attn_export.model_spec.tolerance import rounding_key
from attn_export.runtimes.base import Runtime
from attn_export.runtimes.int8_rounding import INT4_CASE_TIES, with_ties

if TYPE_CHECKING:
    from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["pytorch_trajectories", "recompute", "run_alone", "run_trajectory"]


def run_trajectory(runtime: Runtime, spec: ModelSpec, traj: Trajectory) -> tuple[list[Feeds], str | None]:
    """Each step's outputs, the runtime feeding back its own presents; stops at the first
    step that cannot run, returning why."""
    cache = traj.cache
    results: list[Feeds] = []
    pasts = empty_pasts(spec, cache, traj.sizes[0])
    for k, feeds in enumerate(traj.steps):
        ordered = {t.name: (pasts[t.name] if t.name in pasts else feeds[t.name]) for t in spec.inputs}
        try:
            outputs = runtime.run(ordered)
        except AttnExportError as e:
            return results, f"step {k + 1}: {e}"
        results.append(outputs)
        pasts = {past: outputs[present] for past, present in cache.pairs}
    return results, None


def pytorch_trajectories(
    eager: TorchRuntime, spec: ModelSpec, cache: CacheSpec, n_steps: int, seed: int
) -> list[tuple[Trajectory, list[Feeds]]]:
    """Every scenario planned and run by the PyTorch module, with its float32 floor at
    every step; a module that cannot decode is a GraphCheckError."""
    out = []
    for scenario in layouts(spec, cache):
        traj = plan_trajectory(spec, cache, scenario, n_steps, seed)
        outputs, error = run_trajectory(eager, spec, traj)
        if error:
            grew = [
                (k + 1, g) for k, o in enumerate(outputs) for g in cache_growth(spec, cache, traj.sizes[k], None, o)
            ]
            before = f"; before that, {grew[0][1].reason(grew[0][0])}" if grew else ""
            raise GraphCheckError(f"{spec.name}: decode {scenario}: PyTorch failed at {error}{before}")
        inputs = step_inputs(spec, traj, outputs)
        # int4's values and ties are the rounded trajectory's (``_rounded_trajectories``)
        allowed = [eager.allowances(i, o, ties=False) for i, o in zip(inputs, outputs, strict=True)]
        traj.floors, traj.int8 = [f for f, _ in allowed], [r for _, r in allowed]
        _rounded_trajectories(eager, spec, traj, outputs)
        out.append((traj, outputs))
    return out


def _rounded_trajectories(eager: TorchRuntime, spec: ModelSpec, traj: Trajectory, outputs: list[Feeds]) -> None:
    """Each step's rounding as the module rounded like a quantized graph strays over the
    whole trajectory, feeding back its own rounded presents as the graph does (each step
    alone on PyTorch's pasts misses what the earlier steps' rounding left in the cache);
    the larger of the two is kept, by ``rounding_key``. int4's trajectory is what a right
    CPU graph gives to float32 noise: its values and its near ties' room (``with_ties``)
    are the trajectory's, or none where a nudged one fails."""
    for bits in eager.rounding_bits:
        with eager.rounding(bits) as quantized:
            steps, error = run_trajectory(quantized, spec, traj)
        if error:
            continue  # a module the rounding breaks keeps its per-step roundings
        for k, (exact, approx) in enumerate(zip(outputs, steps, strict=False)):
            for name, value in exact.items():
                key, drift = rounding_key(bits, name), Rounding.between(value, approx[name])
                traj.int8[k][key] = traj.int8[k].get(key, Rounding()).widest(drift)
        runs = [_nudged(eager, spec, traj, tie) for tie in INT4_CASE_TIES] if bits == 4 else []
        nudged = [run for run in runs if run is not None]
        if runs and len(nudged) == len(runs):
            for k, approx in enumerate(steps):
                traj.int8[k] |= with_ties(traj.int8[k], approx, [run[k] for run in nudged])


def _nudged(eager: TorchRuntime, spec: ModelSpec, traj: Trajectory, tie: float) -> list[Feeds] | None:
    """int4's trajectory with its activation codes nudged by ``tie``; None where it fails."""
    with eager.rounding(4, tie) as quantized:
        steps, error = run_trajectory(quantized, spec, traj)
    return None if error else steps


def run_alone(runtime: Runtime, spec: ModelSpec, cache: CacheSpec, tokens: Feeds, keep: np.ndarray) -> Feeds:
    """One call without a cache on ``tokens`` (every position), as the module would see them."""
    return runtime.run(alone_feeds(spec, cache, tokens, keep))


def recompute(runtime: Runtime, spec: ModelSpec, traj: Trajectory) -> Feeds | None:
    """The module without a cache, in one pass over every token of the trajectory (as many
    as the declared seq range holds), or None where not even the prompt fits. Every row of
    every step is compared with the same row of this one pass: a module whose later tokens
    change earlier outputs (no causal mask) or whose result depends on how many keys it
    sees (a scale from the key count) disagrees with it from the first step on."""
    length = pass_length(spec, traj)
    if length < traj.prompt:
        return None
    return runtime.run(one_pass_feeds(spec, traj, length))
