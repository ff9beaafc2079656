"""localize's verdict for the terminal: the case, the outputs, the first region whose own
error breaks the tolerance (node, op, FX node, module path, source line), and the command
that reruns it."""

from __future__ import annotations

from attn_export.compare.outputs import OutputComparison
from attn_export.pipelines.localize import LocalizeReport
from attn_export.spec.shapes import format_sizes

__all__ = ["format_localize"]


def _error(c: OutputComparison | None) -> str:
    if c is None:
        return "not computed"
    if not c.shape_ok:
        return f"shape {c.actual_shape} != PyTorch's {c.expected_shape}"
    if c.unexpected_nonfinite:
        return f"{c.unexpected_nonfinite} NaN/Inf where PyTorch is finite"
    return f"max abs {c.max_abs_error:.3g} ({c.mismatched}/{c.total} outside atol={c.atol:.3g} rtol={c.rtol:g})"


def format_localize(report: LocalizeReport) -> str:
    case = f"{format_sizes(report.sizes)}, seed {report.seed}, {report.distribution}"
    case += f", mask case {report.mask_case}" if report.mask_case else ""
    lines = [f"localize {report.model} at {case} on onnxruntime[{report.provider}]"]
    for o in report.outputs:
        lines.append(f"  output {o.reason() if not o.passed else o.name + ': agrees'}")
    lines += [f"  note: {n}" for n in report.notes]
    compared = f"{len(report.regions)} regions compared ({report.uncompared} without a PyTorch value)"
    r = report.first
    if report.agrees:
        lines.append(f"AGREES: the graph gives PyTorch's outputs here; {compared}")
    elif r is None:
        lines.append(f"DIVERGES, but no compared region tells where; {compared}")
    elif report.cause == "module":
        lines.append(f"THE MODULE gives NaN or Inf, and the graph does the same; first at {r.where()}")
        lines.append(f"  {compared}")
    else:
        first = "first at" if report.cause == "graph" else "first outside the tolerance (no region alone breaks it) at"
        lines.append(f"DIVERGES {first} {r.where()}")
        lines.append(f"  its own error (run alone on PyTorch's values): {_error(r.local)}")
        lines.append(f"  in the whole graph: {_error(r.propagated)}")
        lines.append(f"  {compared}")
    lines.append(f"reproduce: {report.reproduce}")
    return "\n".join(lines)
