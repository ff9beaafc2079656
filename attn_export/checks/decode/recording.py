"""Decode trajectories in the golden file: build records PyTorch's steps (each step's feeds
with the pasts PyTorch fed itself, and its outputs) and ``verify --golden`` reads them back,
checked whole, to replay them on the graph."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from attn_export.artifacts.golden import GoldenCase, Sight
from attn_export.checks.decode.plan import LAYOUTS, Feeds, Trajectory, layouts, step_inputs
from attn_export.errors import ArtifactError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import CacheSpec

__all__ = ["read_trajectories", "record_trajectory", "recorded_label", "split_recorded_label"]

_LABEL = "decode"


def record_trajectory(
    spec: ModelSpec, traj: Trajectory, outputs: list[Feeds], sights: Mapping[str, Sight]
) -> list[GoldenCase]:
    """The steps as golden cases: each step's feeds with the pasts PyTorch fed itself, and
    its outputs (``verify --golden`` replays them, feeding the graph its own pasts), with
    what a query of the module sees (``GoldenCase.sights``)."""
    return [
        GoldenCase(
            recorded_label(traj.scenario, k + 1),
            traj.sizes[k],
            inputs,
            out,
            dict(traj.floors[k]),
            dict(traj.int8[k]) if k < len(traj.int8) else {},
            dict(sights),
        )
        for k, (inputs, out) in enumerate(zip(step_inputs(spec, traj, outputs), outputs, strict=True))
    ]


def recorded_label(scenario: str, step: int) -> str:
    """A golden case label for one recorded step: ``decode-<scenario>-<step>``."""
    return f"{_LABEL}-{scenario}-{step}"


def split_recorded_label(label: str) -> tuple[str, int] | None:
    """(scenario, step) of a recorded decode step's label, else None."""
    head, _, step = label.rpartition("-")
    prefix, _, scenario = head.partition("-")
    if prefix != _LABEL or scenario not in LAYOUTS or not step.isdigit():
        return None
    return scenario, int(step)


def read_trajectories(
    path: Path, cases: list[GoldenCase], spec: ModelSpec, cache: CacheSpec, n_steps: int
) -> list[tuple[Trajectory, list[dict[str, np.ndarray]]]]:
    """The trajectories build recorded in the golden file: each step's feeds (the pasts
    are replaced by the graph's own presents when replayed) and PyTorch's outputs. Every
    scenario must be there, its steps from the prompt on without a gap."""
    by_scenario: dict[str, dict[int, GoldenCase]] = {}
    for case in cases:
        where = split_recorded_label(case.label)
        if where is not None:
            by_scenario.setdefault(where[0], {})[where[1]] = case
    out = []
    for scenario in layouts(spec, cache):
        recorded = by_scenario.get(scenario, {})
        count = len(recorded)
        if not recorded or sorted(recorded) != list(range(1, count + 1)) or recorded[1].sizes[cache.past_dim] != 0:
            raise ArtifactError(
                f"{path}: the decode recording of '{scenario}' is missing or has gaps (steps {sorted(recorded)}); "
                "rebuild with attn-export build"
            )
        steps = [recorded[k] for k in range(1, min(count, n_steps + 1) + 1)]
        notes = (
            [f"{len(steps) - 1} of {n_steps} decode steps: the recording has {count - 1}"] if count <= n_steps else []
        )
        prompt = steps[0].sizes[cache.seq_dim]
        mask = next((t for t in spec.inputs if t.name == cache.mask), None)
        if mask is not None and mask.mask is not None:
            # the prompt's mask, then each step's new token (a window's mask covers no more)
            masks = [mask.mask.keep(c.inputs[mask.name]) for c in steps]
            keep = np.concatenate([masks[0], *(m[:, -1:] for m in masks[1:])], axis=1)
        else:
            keep = np.ones((steps[0].inputs[cache.pairs[0][0]].shape[0], prompt + len(steps) - 1), dtype=bool)
        sizes = [spec.with_sums(c.sizes) for c in steps]
        out.append(
            (
                Trajectory(
                    scenario,
                    cache,
                    keep,
                    prompt,
                    [c.inputs for c in steps],
                    sizes,
                    notes=notes,
                    floors=[c.floors for c in steps],
                    int8=[c.int8 for c in steps],
                ),
                [c.outputs for c in steps],
            )
        )
    return out
