"""Terminal and Markdown tables for ``attn-export bench``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from attn_export.artifacts.files import write_output
from attn_export.pipelines.bench.results import BenchReport, BenchRow, DecodeBenchReport, DecodeRow
from attn_export.report.base import BenchFormat

__all__ = [
    "BENCH_FORMAT",
    "BENCH_WIDTHS",
    "DECODE_WIDTHS",
    "Widths",
    "bench_header",
    "decode_header",
    "format_bench_row",
    "format_bench_summary",
    "format_decode_row",
    "format_decode_summary",
    "markdown_bench_table",
    "markdown_decode_table",
    "write_markdown",
]


@dataclass(frozen=True)
class Widths:
    """The widths of a table's MODEL and RUNNER columns. Rows are printed as they come, so
    the widths are fixed before the first: wide enough for every name the run can print."""

    model: int
    runner: int

    def fitting(self, models: Iterable[str], runners: Iterable[str]) -> Widths:
        """These widths, widened to the longest of ``models`` and ``runners``."""
        return Widths(max([self.model, *map(len, models)]), max([self.runner, *map(len, runners)]))


BENCH_WIDTHS = Widths(14, 18)
DECODE_WIDTHS = Widths(18, 16)


def bench_header(w: Widths = BENCH_WIDTHS) -> str:
    return (
        f"{'MODEL':<{w.model}} {'RUNNER':<{w.runner}} {'BATCH':>5} {'SEQ':>6} {'P50_MS':>9} {'P90_MS':>9} "
        f"{'TOKENS/S':>10} {'VS_EAGER':>8} {'GFLOP/S':>8} {'PEAK%':>6}"
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _compiled(r: BenchRow | DecodeRow) -> str:
    """A compiling runner's one-off seconds, as a row's trailing note."""
    return "" if r.compile_s is None else f"  compile {r.compile_s:.2f} s"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_OUTSIDE = "outside the verified range"


def _flags(r: BenchRow) -> list[str]:
    """What a prefill row's figures come with: outside the verified range, noisy."""
    return ([] if r.in_verified_range else [_OUTSIDE]) + ([r.noise] if r.noise else [])


def format_bench_row(r: BenchRow, w: Widths = BENCH_WIDTHS) -> str:
    flag = _compiled(r) + "".join(f"  ({f})" if f == _OUTSIDE else f"  {f}" for f in _flags(r))
    return (
        f"{r.model:<{w.model}} {r.runner:<{w.runner}} {r.batch:>5} {r.seq:>6} {r.latency.p50_ms:>9.3f} "
        f"{r.latency.p90_ms:>9.3f} {r.tokens_per_s:>10.0f} {_ratio(r.ratio_to_eager):>8} {r.gflops:>8.1f} "
        f"{100 * r.peak_share:>5.1f}%{flag}"
    )


def format_bench_summary(report: BenchReport) -> str:
    peak = report.peak_gflops
    lines = [
        f"machine: {report.machine}; threads {report.threads}; provider {report.provider}",
        f"float32 GEMM peak (2048^3): {peak['peak']:.1f} GFLOP/s "
        f"(torch {peak['torch']:.1f}, onnxruntime {peak['onnxruntime']:.1f})",
    ]
    return "\n".join(lines + _runner_lines(report) + _memory_lines(report.memory_mb))


def markdown_bench_table(report: BenchReport) -> str:
    compiled = _any_compiled(report)
    lines = [
        "| model | runner | batch | seq | p50 (ms) | p90 (ms) | tokens/s | vs eager | GFLOP/s | % of peak |"
        + (" compile (s) |" if compiled else "")
        + " note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if compiled else "") + "---|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.model} | {r.runner} | {r.batch} | {r.seq} | {r.latency.p50_ms:.3f} | {r.latency.p90_ms:.3f} | "
            f"{r.tokens_per_s:.0f} | {_ratio(r.ratio_to_eager)} | {r.gflops:.1f} | {100 * r.peak_share:.1f} |"
            + (f" {_seconds(r.compile_s)} |" if compiled else "")
            + f" {'; '.join(_flags(r)) or '-'} |"
        )
    return "\n".join(lines + _after_table(report)) + "\n"


def decode_header(w: Widths = DECODE_WIDTHS) -> str:
    return (
        f"{'MODEL':<{w.model}} {'RUNNER':<{w.runner}} {'BATCH':>5} {'PAST':>6} {'SEQ':>4} {'MS/STEP':>9} "
        f"{'P90_MS':>9} {'TOKENS/S':>10} {'VS_EAGER':>8} {'MB/TOK':>7} {'GB/S':>6} {'VS_LIMIT':>8} {'OUT%':>5} "
        f"{'SHARED':>6}  VERDICT"
    )


def _physics(r: DecodeRow) -> tuple[str, str, str, str]:
    """Bytes per token (MB), GB/s, the ratio to the bandwidth limit, the share outside kernels."""
    mb = "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 1e6:.2f}"
    gbps = "-" if r.gbps is None else f"{r.gbps:.1f}"
    out = "-" if r.outside_kernels is None else f"{100 * r.outside_kernels:.0f}%"
    return mb, gbps, _ratio(r.limit_ratio), out


def _shared(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_decode_row(r: DecodeRow, w: Widths = DECODE_WIDTHS) -> str:
    flag = _compiled(r) + (f"  {r.noise}" if r.noise else "")
    mb, gbps, limit, out = _physics(r)
    return (
        f"{r.model:<{w.model}} {r.runner:<{w.runner}} {r.batch:>5} {r.past:>6} {r.seq:>4} {r.latency.p50_ms:>9.3f} "
        f"{r.latency.p90_ms:>9.3f} {r.tokens_per_s:>10.0f} {_ratio(r.ratio_to_eager):>8} "
        f"{mb:>7} {gbps:>6} {limit:>8} {out:>5} {_shared(r.shared_buffer):>6}  {r.verdict or '-'}{flag}"
    )


def _gbps(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} GB/s, numpy copy, 1 thread"


def format_decode_summary(report: DecodeBenchReport) -> str:
    windows = sorted({r.window for r in report.rows})
    runs = " or ".join(map(str, windows)) + (" step" if windows == [1] else " steps") if windows else "- steps"
    scenarios = sorted({r.scenario for r in report.rows if r.scenario})
    step = (
        f"scenario {', '.join(scenarios)}: a step of SEQ tokens" if scenarios else "one decode step (seq 1) per token"
    )
    lines = [
        f"machine: {report.machine}; threads {report.threads}; provider {report.provider}; seed {report.seed}",
        f"{step}; cache prefilled with {report.prefill}; each window runs {runs} from PAST, feeding the "
        "presents back" + ("" if scenarios else " (a window ends early where the spec's past range does)"),
        "verdict: faster/slower than eager only beyond the noise (p90 of one below p50 of the other)",
        "MB/TOK: bytes a step moves per token (weights + cache read + cache written); GB/S: achieved; "
        f"VS_LIMIT: p50 over those bytes at this run's copy bandwidth ({_gbps(report.copy_gbps)}); "
        "OUT%: share of an ONNX Runtime step outside kernels (profiled apart); "
        "SHARED: a cache updated in place, past and present one buffer at every step (address and writes checked)",
    ]
    return "\n".join(lines + _runner_lines(report) + _memory_lines(report.memory_mb))


def markdown_decode_table(report: DecodeBenchReport) -> str:
    compiled = _any_compiled(report)
    lines = [
        "| model | runner | batch | past | seq | ms/step p50 | p90 | tokens/s | vs eager "
        "| MB/token | GB/s | vs limit | outside kernels | shared buffer | verdict |"
        + (" compile (s) |" if compiled else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|" + ("---:|" if compiled else ""),
    ]
    for r in report.rows:
        verdict = (r.verdict or "-") + (f" ({r.noise})" if r.noise else "")
        mb, gbps, limit, out = _physics(r)
        lines.append(
            f"| {r.model} | {r.runner} | {r.batch} | {r.past} | {r.seq} | {r.latency.p50_ms:.3f} | "
            f"{r.latency.p90_ms:.3f} | {r.tokens_per_s:.0f} | {_ratio(r.ratio_to_eager)} | "
            f"{mb} | {gbps} | {limit} | {out} | {_shared(r.shared_buffer)} | {verdict} |"
            + (f" {_seconds(r.compile_s)} |" if compiled else "")
        )
    return "\n".join(lines + _after_table(report)) + "\n"


def _any_compiled(report: BenchReport | DecodeBenchReport) -> bool:
    return any(r.compile_s is not None for r in report.rows)


def _unavailable_lines(report: BenchReport | DecodeBenchReport) -> list[str]:
    """Each runner asked for that could not run, and why; what a row times where its label
    does not say."""
    return [f"{runner} not timed: {why}" for runner, why in report.unavailable.items()] + [
        f"{runner} {note}" for runner, note in report.graph_notes.items()
    ]


def _after_table(report: BenchReport | DecodeBenchReport) -> list[str]:
    """The runners that could not run, a paragraph apart (a line right under a table is a row)."""
    lines = _unavailable_lines(report)
    return ["", *lines] if lines else []


def _runner_lines(report: BenchReport | DecodeBenchReport) -> list[str]:
    """What the compile note means, where a row has one, and the runners that could not run."""
    note = (
        ["compile: seconds a compiling runner's first calls at that shape spent compiling (once, not in the latency)"]
        if _any_compiled(report)
        else []
    )
    return note + _unavailable_lines(report)


def _memory_lines(memory_mb: dict[str, dict[str, float | None]]) -> list[str]:
    """Peak memory per model and runner ("-" where it was not measured)."""
    return [
        f"peak memory {model}: " + ", ".join(f"{k} {'-' if v is None else f'{v:.0f} MiB'}" for k, v in runners.items())
        for model, runners in memory_mb.items()
    ]


def write_markdown(report: BenchReport | DecodeBenchReport, path: Path) -> None:
    """The run's table in Markdown: per shape for bench, per past length for ``--decode``."""
    table = markdown_decode_table(report) if isinstance(report, DecodeBenchReport) else markdown_bench_table(report)
    write_output(path, table.encode())


BENCH_FORMAT = BenchFormat("markdown", write_markdown, "Write a Markdown table.")
