"""Terminal lines for ``attn-export build`` and ``attn-export list``."""

from __future__ import annotations

from attn_export.model_spec import ModelSpec
from attn_export.pipelines.building import BuildResult, BuildSummary

__all__ = ["format_build_line", "format_build_summary", "format_spec_table", "traceback_lines"]


def format_build_line(r: BuildResult) -> str:
    """One line per model as it finishes."""
    status = {"built": "built  ", "skipped": "skipped", "failed": "FAILED "}[r.status]
    line = f"{status} {r.name:<30} {r.seconds:7.2f} s"
    if r.status == "skipped":
        line += "  (unchanged; --force rebuilds)"
    if "chosen" in r.info:
        line += f"  (auto chose {r.info['chosen']} on {r.info['provider']})"
    elif r.info.get("fusions"):
        line += "  (fused: " + ", ".join(f"{k} {v}" for k, v in r.info["fusions"].items()) + ")"
    if r.error:
        line += f"  [{r.failed_stage}] {r.error}" if r.failed_stage else f"  {r.error}"
    for w in r.warnings:
        line += f"\n        warning: {w}"
    return line + traceback_lines(r)


def traceback_lines(r: BuildResult) -> str:
    """The failure's traceback on the lines after its own (``--debug``), or ""."""
    return f"\n{r.traceback.rstrip()}" if r.traceback else ""


def format_build_summary(s: BuildSummary) -> str:
    c = s.counts
    return (
        f"{len(s.results)} graphs: {c['built']} built, {c['skipped']} skipped, {c['failed']} failed "
        f"in {s.seconds:.1f} s "
        + (f"-> {s.out_dir}/manifest.json" if s.manifest else f"(nothing written to {s.out_dir})")
    )


def _shape(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_spec_table(specs: list[ModelSpec]) -> str:
    """The zoo: name, module, inputs with dims, opset, exporter."""
    rows = [("NAME", "MODULE", "INPUTS", "OPSET", "EXPORTER")]
    for s in specs:
        inputs = " ".join(f"{t.name}{_shape(t.shape)}" + (f"({t.mask.pattern})" if t.mask else "") for t in s.inputs)
        rows.append((s.name, s.module, inputs, str(s.opset), s.exporter))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) if i < 4 else cell for i, cell in enumerate(row)).rstrip() for row in rows
    )
