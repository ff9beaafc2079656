"""localize's verdict for the terminal: the case, the outputs, the first region whose own
error breaks the tolerance (node, op, FX node, module path, source line) — where the
outputs agree too ("OUTPUTS AGREE, but region ..."), and the command that reruns it."""

from __future__ import annotations

import os

from attn_export.compare.outputs import OutputComparison
from attn_export.model_spec.shapes import format_sizes
from attn_export.pipelines.localize import LocalizeReport, RegionError, ReplayResult

__all__ = ["format_localize", "format_replay", "where"]


def _printable(lines: list[str]) -> str:
    """The lines for a terminal, each one line as written: recorded text in them (a source
    line, the names a graph or a bundle carries: data) has every non-printable character
    escaped (``\\n``, ``\\x1b``), so none clears the screen or starts a line of its own (a
    forged "AGREES")."""
    return "\n".join("".join(c if c.isprintable() else repr(c)[1:-1] for c in line) for line in lines)


def _source(source: str) -> str:
    """``file:line``, the file relative to the working directory when it lies under it."""
    path, _, line = source.rpartition(":")
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return source
    return f"{relative}:{line}" if not relative.startswith("..") else source


def where(region: RegionError) -> str:
    """``ONNX node [Op] from FX node name (aten op) in module.path at file:line `code```: the
    node that computes the compared value, and the region's other nodes counted."""
    op = "+".join(dict.fromkeys(region.ops))
    more = f" (+{len(region.nodes) - 1} nodes)" if len(region.nodes) > 1 else ""
    nodes = (region.node or "".join(region.nodes[:1])) + more
    parts = [f"ONNX {nodes} [{op}]"] if region.nodes else []
    parts.append(f"{'from ' if region.nodes else ''}FX node {region.fx_node} ({region.target})")
    if region.module_path:
        parts.append(f"in {region.module_path}")
    if region.source:
        parts.append(f"at {_source(region.source)}" + (f" `{region.code}`" if region.code else ""))
    if region.covers:
        span = ", ".join(region.covers) if len(region.covers) <= 4 else f"{region.covers[0]} … {region.covers[-1]}"
        lines = ", ".join(_source(line) for line in region.lines[:6]) + (" …" if len(region.lines) > 6 else "")
        parts.append(f"(a region standing for {len(region.covers)} FX nodes: {span}; lines {lines})")
    return " ".join(parts)


def _error(c: OutputComparison | None) -> str:
    if c is None:
        return "not computed"
    if not c.shape_ok:
        return f"shape {c.actual_shape} != PyTorch's {c.expected_shape}"
    if c.unexpected_nonfinite:
        return f"{c.unexpected_nonfinite} NaN/Inf where PyTorch is finite"
    said = f"max abs {c.max_abs_error:.3g} ({c.mismatched}/{c.total} outside atol={c.atol:.3g} rtol={c.rtol:g})"
    if not c.rms_ok:
        said += f"; the error's rms {c.rms_error:.3g} over its bound {c.rms_bound:.3g} (rms_rtol)"
    return said


def format_localize(report: LocalizeReport) -> str:
    if report.golden_case is not None:
        case = f"the recorded case {report.golden_case} ({format_sizes(report.sizes)}), PyTorch's values as built"
    elif report.generate_step is not None:
        case = (
            f"generate step {report.generate_step} of {report.layout} ({format_sizes(report.sizes)}), "
            f"PyTorch's tokens before it, seed {report.seed}"
        )
    elif report.decode_step is not None:
        case = f"decode step {report.decode_step} of {report.layout} ({format_sizes(report.sizes)}), seed {report.seed}"
    else:
        case = f"{format_sizes(report.sizes)}, seed {report.seed}, {report.distribution}"
        case += f", mask case {report.mask_case}" if report.mask_case else ""
    lines = [f"localize {report.model} at {case} on {report.target.label}"]
    if report.shrunk_from is not None:
        lines.append(
            f"  the smallest case found that fails at the same place, from {format_sizes(report.shrunk_from)} "
            f"({report.shrink_tries} cases tried)"
        )
    for o in report.outputs:
        lines.append(f"  output {o.reason() if not o.passed else o.name + ': agrees'}")
    lines += [f"  note: {n}" for n in report.notes]
    compared = f"{len(report.regions)} regions compared ({report.uncompared} without a PyTorch value)"
    bug = report.module_bug
    if bug is not None:
        lines.append(
            f"THE MODULE disagrees with itself at this step: with its cache it parts from one pass over every "
            f"token so far first at {where(bug)}: {_error(bug.local)}"
        )
    r = report.first
    hidden = report.hidden_region
    if hidden is not None:
        line = _source(hidden.source) if hidden.source else "no source line"
        lines.append(
            f"OUTPUTS AGREE, but region {hidden.fx_node} ({line}) breaks its tolerance: {_error(hidden.local)}"
        )
        lines.append(f"  at {where(hidden)}")
        lines.append(f"  in the whole graph: {_error(hidden.propagated)}")
        lines.append(f"  {compared}")
    elif report.graph_agrees:
        lines.append(f"AGREES: the graph gives PyTorch's outputs here; {compared}")
    elif r is None:
        lines.append(f"DIVERGES, but no compared region tells where; {compared}")
    elif report.cause == "refused":
        lines.append(f"DIVERGES first at {where(r)}: ONNX Runtime will not run it on PyTorch's values: {r.refused}")
        lines.append(f"  {compared}")
    elif report.cause == "module":
        lines.append(f"THE MODULE gives NaN or Inf, and the graph does the same; first at {where(r)}")
        lines.append(f"  {compared}")
    else:
        first = "first at" if report.cause == "graph" else "first outside the tolerance (no region alone breaks it) at"
        lines.append(f"DIVERGES {first} {where(r)}")
        lines.append(f"  its own error (run alone on PyTorch's values): {_error(r.local)}")
        lines.append(f"  in the whole graph: {_error(r.propagated)}")
        lines.append(f"  {compared}")
    if report.bundle:
        lines.append(f"replay bundle: {report.bundle} (rerun: sh {report.bundle}/reproduce.sh)")
    lines.append(f"reproduce: {report.reproduce}")
    return _printable(lines)


def format_replay(result: ReplayResult) -> str:
    info, c = result.info, result.comparison
    source = f" at {_source(info['source'])}" if info.get("source") else ""
    head = (
        f"replay {info.get('model')}: region of FX node {info.get('fx_node')}{source} on onnxruntime[{result.provider}]"
    )
    verdict = "AGREES with PyTorch's recorded value" if c.passed else f"DIFFERS: {c.reason()}"
    return _printable([head, verdict])
