"""Bench rows for github-action-benchmark's ``customSmallerIsBetter`` tool: a JSON list with
one entry per row (model x runner x shape, or x past length for ``bench --decode``, or x
scenario for ``bench --scenario``), each
``{"name", "unit", "value", "range", "extra"}``, strings but ``value``.

The name is the row's identity and nothing else (model, runner, provider and sizes, no
figure), so the same row keeps its chart from run to run. ``value`` is the p50 latency in
``ms`` (a unit the action converts between s, ms, us and ns), ``range`` is ``± (p90 - p50)``
as the action's ``±`` parser reads it, and ``extra`` holds the row's other figures, one per
line, for the chart's tooltip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attn_export.artifacts.files import write_output
from attn_export.artifacts.json_text import json_text
from attn_export.pipelines.bench.results import BenchReport, BenchRow, DecodeBenchReport, DecodeRow
from attn_export.report.base import BenchFormat

__all__ = ["BENCH_FORMAT", "benchmark_entries", "write_benchmark_json"]

UNIT = "ms"


def _entry(name: str, row: BenchRow | DecodeRow, extra: list[str], where: str) -> dict[str, Any]:
    latency = row.latency
    lines = [f"p90: {latency.p90_ms:.4f} ms", f"repeats: {latency.repeats}", f"tokens/s: {row.tokens_per_s:.0f}"]
    if row.ratio_to_eager is not None:
        lines.append(f"vs torch-eager: {row.ratio_to_eager:.2f}x")
    if row.compile_s is not None:
        lines.append(f"compile: {row.compile_s:.2f} s (once, not in the value)")
    lines += [*extra, *([row.noise] if row.noise else []), where]
    return {
        "name": name,
        "unit": UNIT,
        "value": latency.p50_ms,
        "range": f"± {latency.p90_ms - latency.p50_ms:.4f}",
        "extra": "\n".join(lines),
    }


def _physics(row: DecodeRow) -> list[str]:
    """A decode row's bytes per token, the bandwidth it achieves and its ratio to its limit,
    the share of its step outside kernels and whether its buffer was shared, where known."""
    lines = []
    if row.bytes_per_token is not None:
        lines.append(f"MB/token: {row.bytes_per_token / 1e6:.3f}")
    if row.gbps is not None:
        lines.append(f"GB/s: {row.gbps:.1f}")
    if row.limit_ratio is not None:
        lines.append(f"vs bandwidth limit: {row.limit_ratio:.2f}x")
    if row.outside_kernels is not None:
        lines.append(f"outside kernels: {100 * row.outside_kernels:.0f}%")
    if row.shared_buffer is not None:
        lines.append(f"shared buffer: {'yes' if row.shared_buffer else 'no'}")
    return lines


def benchmark_entries(report: BenchReport | DecodeBenchReport) -> list[dict[str, Any]]:
    """One entry per row, in the report's order; names are unique within a report."""
    where = f"threads: {report.threads}\nmachine: {report.machine}"
    entries = []
    for row in report.rows:
        if isinstance(row, DecodeRow):
            # a scenario's row is its own chart: its name says which, and its tokens per step
            kind, tokens = row.scenario or "decode", f" seq={row.seq}" if row.seq != 1 else ""
            name = f"{row.model} {row.runner} [{report.provider}] {kind} batch={row.batch} past={row.past}{tokens}"
            extra = [f"window: {row.window} steps", *([f"verdict: {row.verdict}"] if row.verdict else [])]
            extra += _physics(row)
        else:
            name = f"{row.model} {row.runner} [{report.provider}] batch={row.batch} seq={row.seq}"
            extra = [f"GFLOP/s: {row.gflops:.1f}"]
            extra += [] if row.in_verified_range else ["outside the verified range"]
        entries.append(_entry(name, row, extra, where))
    return entries


def write_benchmark_json(report: BenchReport | DecodeBenchReport, path: Path) -> None:
    """The entries as strict JSON (bench times are finite: a run that measured nothing has no row)."""
    write_output(path, json_text(benchmark_entries(report), ensure_ascii=False).encode())


BENCH_FORMAT = BenchFormat(
    "benchmark-json",
    write_benchmark_json,
    "Write the rows for github-action-benchmark (tool: customSmallerIsBetter): p50 latency in ms per row.",
)
