"""The reports: renderers format result dataclasses and compute nothing.

``FORMATS`` is the registry of verify's report formats and ``BENCH_FORMATS`` that of
bench's, each written by ``--<name> FILE``: a new format is one module defining a
``ReportFormat`` (or ``BenchFormat``) and one line here.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from attn_export.report import bench_text, benchmark_json, json_report, junit, markdown, plot
from attn_export.report.base import BenchFormat, ReportFormat

if TYPE_CHECKING:
    from attn_export.pipelines.verify import VerifyReport
    from attn_export.report.output_plan import OutputPlan

__all__ = [
    "BENCH_FORMATS",
    "FORMATS",
    "BenchFormat",
    "ReportFormat",
    "write_reports",
]

FORMATS: dict[str, ReportFormat] = {
    json_report.FORMAT.name: json_report.FORMAT,
    junit.FORMAT.name: junit.FORMAT,
    markdown.FORMAT.name: markdown.FORMAT,
}

BENCH_FORMATS: dict[str, BenchFormat] = {
    json_report.BENCH_FORMAT.name: json_report.BENCH_FORMAT,
    bench_text.BENCH_FORMAT.name: bench_text.BENCH_FORMAT,
    plot.BENCH_FORMAT.name: plot.BENCH_FORMAT,
    benchmark_json.BENCH_FORMAT.name: benchmark_json.BENCH_FORMAT,
}


def write_reports(report: VerifyReport, plan: OutputPlan) -> None:
    """verify's (and report merge's) reports by ``plan``: each format's file, the Markdown
    report appended to ``$GITHUB_STEP_SUMMARY`` and the JSON on stdout where it says so."""
    texts = {name: partial(fmt.render, report) for name, fmt in FORMATS.items()}
    plan.write_texts(texts, markdown=texts[markdown.FORMAT.name])
