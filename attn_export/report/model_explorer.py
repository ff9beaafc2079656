"""localize's regions as a Model Explorer node-data overlay (``GraphNodeData`` JSON): each
region's own error over its tolerance, so the graph is coloured in the viewer people already
use for ONNX graphs. A value of at most 1 is within the tolerance (green), above it is not
(red); the blamed region stands out, and the regions after it, which inherit its error but
add none, stay green."""

from __future__ import annotations

import math

from attn_export.artifacts.json_text import json_text
from attn_export.compare.outputs import OutputComparison
from attn_export.pipelines.localize import LocalizeReport

__all__ = ["format_overlay"]

#: JSON has no infinity: a region whose error is infinite (NaN where PyTorch is finite)
#: gets this many times its tolerance.
_CAP = 1e30


def _over_tolerance(c: OutputComparison | None) -> float | None:
    """The region's error as a multiple of what the tolerance allows (at most 1 passes)."""
    if c is None:
        return None
    if not c.shape_ok or not c.dtype_ok:
        return _CAP
    ratio = c.min_passing_atol / c.atol if c.atol > 0 else (0.0 if c.min_passing_atol == 0 else _CAP)
    return min(ratio, _CAP) if math.isfinite(ratio) else _CAP


def format_overlay(report: LocalizeReport) -> str:
    """``{"results": {value name or node name: {"value": x}}, "thresholds": [...]}``: keyed by
    each region's output tensor and by each of its ONNX nodes, as Model Explorer matches them."""
    results: dict[str, dict[str, float]] = {}
    for region in report.regions:
        value = _over_tolerance(region.local)
        if value is None:
            continue
        for key in [region.value, *region.nodes]:
            results[key] = {"value": round(value, 6)}
    doc = {
        "results": results,
        "thresholds": [{"value": 1, "bgColor": "#c8e6c9"}, {"value": _CAP, "bgColor": "#ef9a9a"}],
    }
    return json_text(doc)
