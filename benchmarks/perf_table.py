"""Prefill on CPU: ONNX Runtime's graphs beside PyTorch eager, SDPA and torch.compile, each
row's share of this machine's GEMM peak, and the prefill speed targets.

    python benchmarks/perf_table.py              # build, then 3 whole runs
    python benchmarks/perf_table.py --profile    # also: where ONNX Runtime's seq-128 time goes

Builds (in a temporary folder) the seed MultiHeadAttention at hidden 512, 8 heads
(``benchmarks/models/mha_512.toml``) with the fp32, ort-fused and int8 variants and runs the
pipeline of ``attn-export bench --compile`` at batch 1 and seq 128, 512 and 2048: PyTorch
eager, PyTorch SDPA, ``torch.compile(module, dynamic=True)`` and ONNX Runtime per variant,
each shape's runners timed in turns in alternating blocks, with the same threads on every
side and ONNX Runtime's idle threads not spinning. The whole bench runs ``--repeats`` times:
a cell is the median over the runs of each run's p50, with the lowest and highest in
brackets; its ratios to eager and to torch.compile are taken within each run, and its share
of the GEMM peak against that run's peak (a float32 2048³ GEMM at the same threads, the
faster of PyTorch and ONNX Runtime). Then the targets, each with its measured figure: the
best float32-exact ONNX Runtime variant (not int8) at or below torch.compile and eager at
every seq, and its GEMM-peak share at least 85% at seq 512 and above and 70% at seq 128.

``--profile`` adds ONNX Runtime's own profile of each variant's calls at seq 128, at 1
thread and at ``--threads``: the share of a call outside node kernels (per-call and per-node
overhead), the nodes run per call and each op type's share of kernel time. Nothing here
asserts: figures are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from repeats import (  # benchmarks/repeats.py, next to this script
    float32_exact,
    heading,
    spread,
    started,
    timing_arguments,
)

from attn_export.pipelines.bench.runners import COMPILED, EAGER

HERE = Path(__file__).resolve().parent
SPEC = HERE / "models" / "mha_512.toml"
VARIANTS = ("fp32", "ort-fused", "int8")
SEQS = (128, 512, 2048)
#: The prefill targets: the least GEMM-peak share at these seqs and above.
PEAK_TARGETS = {128: 0.70, 512: 0.85}
PROFILED_SEQ = 128


def gathered(reports: list[Any]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Per (runner, seq), each run's p50 (ms), ratio to eager and to torch.compile (timed in
    turns with it in the same run) and share of that run's GEMM peak."""
    cells: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for report in reports:
        p50 = {(r.runner, r.seq): r.latency.p50_ms for r in report.rows}
        for r in report.rows:
            cell = cells[(r.runner, r.seq)]
            cell["p50"].append(r.latency.p50_ms)
            cell["eager"].append(r.latency.p50_ms / p50[(EAGER, r.seq)])
            cell["compile"].append(r.latency.p50_ms / p50[(COMPILED, r.seq)])
            cell["peak"].append(r.peak_share)
    return cells


def table(cells: dict[tuple[str, int], dict[str, list[float]]]) -> str:
    """Markdown: a row per runner; per seq its p50, its ratios to eager and to torch.compile,
    and its share of the GEMM peak, each median [lowest–highest] over the runs."""
    head = " | ".join(f"seq {s} p50 (ms) | vs eager | vs compile | GEMM peak" for s in SEQS)
    lines = [f"| runner | {head} |", "|---|" + "---:|" * 4 * len(SEQS)]
    for runner in dict.fromkeys(r for r, _ in cells):
        row = []
        for s in SEQS:
            c = cells[(runner, s)]
            peak = [100 * x for x in c["peak"]]
            row += [spread(c["p50"], ".3f"), spread(c["eager"], ".2f", "x"), spread(c["compile"], ".2f", "x")]
            row.append(spread(peak, ".0f", "%"))
        lines.append(f"| {runner} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def targets(
    cells: dict[tuple[str, int], dict[str, list[float]]], variants: tuple[str, ...]
) -> list[tuple[str, str, bool]]:
    """The prefill targets, each with its figure (median [lowest–highest] over the runs) and
    whether its median meets it; at each seq the best variant is the lowest median p50."""
    exact = [f"ort:{v}" for v in variants if float32_exact(v)]
    best = {s: min(exact, key=lambda runner: statistics.median(cells[(runner, s)]["p50"])) for s in SEQS}
    out = []
    for s, who in best.items():
        c = cells[(who, s)]
        out.append(
            (
                f"best float32-exact ORT variant <= torch.compile and eager at seq {s}",
                f"{spread(c['compile'], '.2f', 'x')} compile, {spread(c['eager'], '.2f', 'x')} eager ({who})",
                max(statistics.median(c["compile"]), statistics.median(c["eager"])) <= 1.0,
            )
        )
    for s, who in best.items():
        least = next(share for start, share in sorted(PEAK_TARGETS.items(), reverse=True) if s >= start)
        peak = [100 * x for x in cells[(who, s)]["peak"]]
        met = statistics.median(peak) >= 100 * least
        out.append((f"GEMM-peak share >= {100 * least:.0f}% at seq {s}", f"{spread(peak, '.0f', '%')} ({who})", met))
    return out


def profile_lines(out: Path, manifest: Any, spec: Any, variants: tuple[str, ...], threads: int) -> list[str]:
    """ONNX Runtime's profile of each variant's calls at ``PROFILED_SEQ``, at 1 thread and at ``threads``."""
    from attn_export.model_spec import variant_key
    from attn_export.model_spec.inputs import make_feeds
    from attn_export.pipelines.bench.physics import profile_calls

    feeds = make_feeds(spec, {"batch": 1, "seq": PROFILED_SEQ}, 0)
    lines = []
    for variant in variants:
        path = out / manifest.models[variant_key(spec.name, variant)].file
        for n in dict.fromkeys((1, threads)):
            profile = profile_calls(path, feeds, "cpu", n)
            lines.append(
                f"\nONNX Runtime {variant} at (1, {PROFILED_SEQ}), {n} thread{'s' if n > 1 else ''} "
                f"(enable_profiling, which slows each node: {profile.run_us / profile.runs / 1e3:.3f} ms per call): "
                f"{profile.nodes / profile.runs:.0f} nodes per call, {100 * profile.outside:.0f}% of a call outside "
                "kernels; share of kernel time by op type:"
            )
            lines += [f"  {op:<22} {100 * share:5.1f}%" for op, share in profile.shares().items() if share >= 0.005]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    timing_arguments(
        parser,
        repeats="whole bench runs; cells are their medians",
        budget="seconds of timed calls per runner, seq and run",
        threads="threads on every side (default: the physical cores)",
    )
    parser.add_argument("--profile", action="store_true", help="print ONNX Runtime's profile at seq 128")
    args = parser.parse_args()
    command, threads = started(parser, args, "perf_table.py")

    from attn_export.artifacts.manifest import load_manifest
    from attn_export.model_spec import load_spec
    from attn_export.pipelines.bench.results import BenchOptions
    from attn_export.pipelines.bench.run import run_bench
    from attn_export.pipelines.building import BuildOptions, build_models
    from attn_export.runtimes.timing import load_average

    spec = load_spec(SPEC)
    load_start = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # the first run compiles cold
        out = Path(tmp) / "build"
        t0 = time.perf_counter()
        built = build_models([SPEC], BuildOptions(out, variants=VARIANTS))
        if not all(r.ok for r in built.results):
            sys.exit("; ".join(f"{r.name}: {r.error}" for r in built.results if not r.ok))
        build_s = time.perf_counter() - t0
        manifest = load_manifest(out)
        options = BenchOptions(
            batches=[1],
            seqs=SEQS,
            variants=VARIANTS,
            threads=threads,
            budget_s=args.budget,
            memory=False,
            torch_compile=True,
        )
        reports = [run_bench(out, manifest, [spec], options) for _ in range(args.repeats)]
        profile = profile_lines(out, manifest, spec, VARIANTS, threads) if args.profile else []
    load_end = load_average()

    first = reports[0]
    print(heading(command, first.machine, first.versions))
    print(
        f"load average {load_start or 0:.2f} at the start, {load_end or 0:.2f} at the end; build {build_s:.1f} s; "
        f"{args.repeats} whole runs, {args.budget:g} s of timed calls per runner, seq and run\n"
    )
    print(
        f"Prefill, batch 1, {threads} threads on every side, ONNX Runtime's idle threads not spinning; "
        "each cell the median [lowest–highest] over the runs:\n"
    )
    cells = gathered(reports)
    print(table(cells))
    peaks = ", ".join(
        "{peak:.0f} (torch {torch:.0f}, onnxruntime {onnxruntime:.0f})".format(**r.peak_gflops) for r in reports
    )
    print(f"\nfloat32 GEMM peak (2048³, {threads} threads), GFLOP/s per run: {peaks}")
    compiled = [r.compile_s for r in first.rows if r.runner == COMPILED]
    print(
        f"{COMPILED} compile in the first run (cold Inductor cache, not in the latency): "
        + ", ".join(f"seq {s} {c or 0:.2f} s" for s, c in zip(SEQS, compiled, strict=True))
    )
    print("\n| target | measured (median over the runs) | met |\n|---|---|---|")
    for name, measured, met in targets(cells, VARIANTS):
        print(f"| {name} | {measured} | {'yes' if met else 'no'} |")
    print("\n".join(profile))


if __name__ == "__main__":
    main()
