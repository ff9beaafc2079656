"""A decoder whose step with its cache disagrees with one pass of the module over every
token so far (a bug in the module, not the graph): the first FX node where the two PyTorch
runs part, found by running the same FX program both ways and comparing node by node."""

from __future__ import annotations

from typing import Any

import numpy as np

from attn_export.checks.decode.plan import Trajectory, one_pass_feeds, pass_length
from attn_export.compare.outputs import judge_value
from attn_export.model_spec import ModelSpec, Tolerance
from attn_export.pipelines.localize.judge import left_out, region_tolerance
from attn_export.pipelines.localize.results import RegionError
from attn_export.pipelines.localize.values import TorchValues, torch_values

__all__ = ["parting_node"]


def _aligned(step: tuple[int, ...], whole: np.ndarray, past: int, seq: int) -> np.ndarray | None:
    """The one pass's value where the step has one: an axis as long as the step's tokens is
    a query axis (cut to the step's rows), one as long as every token so far a key axis
    (cut to those keys); None where the shapes do not correspond so."""
    if len(step) != whole.ndim:
        return None
    out = whole
    for axis, (mine, theirs) in enumerate(zip(step, whole.shape, strict=True)):
        if mine == theirs:
            continue
        if mine == seq:
            out = np.take(out, range(past, past + seq), axis=axis)
        elif mine == past + seq and theirs > mine:
            out = np.take(out, range(past + seq), axis=axis)
        else:
            return None
    return out


def parting_node(
    program: Any, spec: ModelSpec, traj: Trajectory, step: int, cached: TorchValues, budget: int, tol: Tolerance
) -> RegionError | None:
    """The first FX node (in the program's order) whose value at decode step ``step`` (1 =
    the prompt), computed with the cache (``cached``), differs from its value in one pass
    over every token of the trajectory (as verify --decode recomputes it) at the same
    tokens; None where they agree, or where the pass does not reach the step."""
    # the step's tokens in the whole sequence (a sliding window's past holds fewer before them)
    past, stop = traj.span(step - 1)
    seq = stop - past
    length = pass_length(spec, traj)
    if stop > length:
        return None
    whole = torch_values(program, spec, one_pass_feeds(spec, traj, length), budget)
    padded = ~traj.keep[:, past:stop]  # a padded query has nothing to agree on
    for name, value in cached.items():
        if value.dtype.kind != "f":  # positions, masks: their meaning differs between the two calls,
            continue  # and what they do shows in the first float they feed
        expected = _aligned(value.shape, whole[name], past, seq) if name in whole else None
        if expected is None or expected.dtype != value.dtype or expected.shape != value.shape:
            continue
        compared = judge_value(name, expected, left_out(expected, value, padded), region_tolerance(tol, expected))
        if not compared.passed:
            target, source, code = cached.sources.get(name, ("", "", ""))
            return RegionError(name, name, [], [], target, "", source, code, local=compared, propagated=None)
    return None
