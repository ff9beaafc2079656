"""Verify's placement step: for each target with execution providers, where ONNX Runtime ran
each node of the graph, read once per model and target from a profiled run of its own after
the timed runs (``Runtime.placement``), and the cases it fails under ``--require-placement``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from attn_export.errors import AttnExportError, UsageError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import fed_sizes
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.memory import memory_budget
from attn_export.model_spec.shapes import example_sizes
from attn_export.pipelines.verify.results import CaseResult, PlacementResult, VerifyOptions
from attn_export.runtimes import PROVIDERS, RUNTIMES
from attn_export.runtimes.placement import Placement

__all__ = ["gate_cases", "model_placement"]


def model_placement(name: str, path: Path, spec: ModelSpec, options: VerifyOptions) -> list[PlacementResult]:
    """The graph at ``path`` on each target, run once at the spec's example sizes (which
    nodes run does not depend on the values, and ONNX Runtime places nodes when it loads
    the graph); a run that fails is a placement that could not be read."""
    budget = memory_budget(options.max_memory, spec)
    feeds = make_feeds(spec, fed_sizes(spec, example_sizes(spec)), options.seed)
    found = []
    for target in options.targets:
        runtime = RUNTIMES[target.runtime].make(path, spec, target, options.threads, budget, options.region_timeout_s)
        try:
            placement = runtime.placement(feeds)
        except UsageError:
            raise
        except AttnExportError as e:
            placement = Placement(PROVIDERS[target.provider or "cpu"].execution_provider, error=str(e))
        if placement is not None:
            found.append(PlacementResult(name, target, placement, options.placement_required(target)))
    return found


def gate_cases(cases: Sequence[CaseResult], placements: Sequence[PlacementResult]) -> None:
    """Fail every case of a model and target whose placement fails, saying why."""
    gates = {(p.model, p.target): p.gate for p in placements}
    for case in cases:
        case.placement_gate = gates.get((case.model, case.target))
