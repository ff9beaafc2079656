"""Verify's decode steps: every scenario's trajectory on every target, against PyTorch (with
its own recompute and rows alone) or against build's recording in golden mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attn_export.artifacts.golden import GoldenCase
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.checks.decode.judge import compare_trajectories, unpadded
from attn_export.checks.decode.plan import Trajectory
from attn_export.checks.decode.recording import read_trajectories
from attn_export.checks.decode.results import DecodeResult
from attn_export.checks.decode.run import pytorch_trajectories, recompute, run_trajectory
from attn_export.compare import OutputComparison
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import CacheSpec
from attn_export.model_spec.memory import memory_budget
from attn_export.model_spec.tolerance import rounding_bits
from attn_export.pipelines.verify.expected import int4_activations, target_tolerances, tolerances_for
from attn_export.pipelines.verify.results import VerifyOptions
from attn_export.runtimes import RUNTIMES
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["decode_model"]


def decode_model(
    out_dir: Path,
    entry: ManifestEntry,
    spec: ModelSpec,
    cache: CacheSpec,
    options: VerifyOptions,
    golden: list[GoldenCase],
) -> list[DecodeResult]:
    """Every scenario's trajectory on every target: against PyTorch (and PyTorch against its
    own recompute and its rows alone), or in golden mode against what build recorded."""
    path = out_dir / entry.file
    tolerances = tolerances_for(spec, entry.variant, options)
    # (trajectory, expected outputs, one pass over every token, each padded row alone)
    plans: list[tuple[Trajectory, list[dict[str, np.ndarray]], dict[str, np.ndarray] | None, list[OutputComparison]]]
    if options.golden:
        recorded = read_trajectories(out_dir / entry.golden, golden, spec, cache, options.steps)
        plans = [(traj, outputs, None, []) for traj, outputs in recorded]
        expected_from = "golden"
    else:
        from attn_export.exporter.factory import instantiate

        bits = rounding_bits(tolerances.values())
        activations = int4_activations(path, bits)
        with TorchRuntime(
            instantiate(spec), spec.inputs, spec.outputs, spec.dims, rounding_bits=bits, int4_activations=activations
        ) as eager:
            plans = [
                (
                    traj,
                    outputs,
                    recompute(eager, spec, traj),
                    unpadded(eager, spec, traj, outputs, tolerances) if traj.scenario == "left-padded" else [],
                )
                for traj, outputs in pytorch_trajectories(eager, spec, cache, options.steps, options.seed)
            ]
        expected_from = eager.name
    results = []
    budget = memory_budget(options.max_memory, spec)
    for target in options.targets:
        with RUNTIMES[target.runtime].make(
            path, spec, target, options.threads, budget, options.region_timeout_s
        ) as runtime:
            for traj, expected, full, alone in plans:
                actual, error = run_trajectory(runtime, spec, traj)
                result = DecodeResult(
                    entry.name,
                    target,
                    traj.scenario,
                    expected_from,
                    traj.prompt_lengths,
                    unpadded=alone,
                    notes=traj.notes,
                )
                judged = target_tolerances(spec, entry.variant, options, target, path)
                result.steps = compare_trajectories(spec, traj, expected, actual, judged, error, full)
                results.append(result)
    return results
