"""Reproduce the performance table of the docs (docs/performance.md) and check the
project's speed targets.

    python benchmarks/perf_table.py            # a few minutes on 2 cores
    python benchmarks/perf_table.py --profile  # also break ONNX Runtime's time down by op

Builds the reference model (the seed MultiHeadAttention, hidden 512, 8 heads) with the
fp32, ort-fused and int8 variants, times them against PyTorch eager and PyTorch SDPA at
batch 1 and sequence 128, 512 and 2048, and prints a Markdown table, the machine, the
date, and each target with the measured figure. Nothing here asserts: figures are printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _row(report, runner: str, seq: int):
    return next(r for r in report.rows if r.runner == runner and r.seq == seq and r.batch == 1)


def _profile(model: Path, seq: int, threads: int) -> dict[str, float]:
    """Share of ONNX Runtime's kernel time per op type, from SessionOptions.enable_profiling."""
    import numpy as np

    from attn_export.runtimes.ort import load_session

    with tempfile.TemporaryDirectory() as tmp:
        session = load_session(model, "cpu", threads=threads, profile_prefix=Path(tmp) / "profile")
        feeds = {
            i.name: np.random.default_rng(0).standard_normal((1, seq, 512)).astype(np.float32)
            for i in session.get_inputs()
        }
        for _ in range(10):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    total = sum(per_op.values())
    return {op: us / total for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed repeats per runner and shape")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from attn_export.artifacts.manifest import load_manifest
    from attn_export.pipelines.bench.results import BenchOptions
    from attn_export.pipelines.bench.run import run_bench
    from attn_export.pipelines.build import BuildOptions, build_models
    from attn_export.report.bench_text import format_bench_summary, markdown_bench_table
    from attn_export.runtimes.timing import physical_cores
    from attn_export.spec import load_spec

    spec_path = HERE / "models" / "mha_512.toml"
    variants = ("fp32", "ort-fused", "int8")
    t0 = time.perf_counter()
    build = build_models([spec_path], BuildOptions(args.out, variants=variants))
    assert all(r.ok for r in build.results), [r.error for r in build.results]
    build_s = time.perf_counter() - t0
    threads = physical_cores()
    report = run_bench(
        args.out,
        load_manifest(args.out),
        [load_spec(spec_path)],
        BenchOptions(batches=[1], seqs=[128, 512, 2048], variants=variants, threads=threads, budget_s=args.budget),
    )

    # The zoo's own build and verify times, cold (fresh folder) and with nothing changed.
    with tempfile.TemporaryDirectory() as tmp:
        timings = {}
        for label, cmd in (
            ("build, cold", ["build", "--out", tmp]),
            ("build, unchanged", ["build", "--out", tmp]),
            ("verify with latency", ["verify", tmp]),
        ):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "attn_export", *cmd], cwd=ROOT, check=True, capture_output=True)
            timings[label] = time.perf_counter() - start

    print(
        f"Measured {datetime.date.today().isoformat()} on {report.machine}, {threads} threads, "
        f"with `python benchmarks/perf_table.py` ({', '.join(f'{k} {v}' for k, v in report.versions.items())}).\n"
    )
    print(markdown_bench_table(report))
    print(format_bench_summary(report))
    eager = {s: _row(report, "torch-eager", s).latency.p50_ms for s in (128, 512, 2048)}
    fp32 = {s: _row(report, "ort:fp32", s).latency.p50_ms for s in (128, 512, 2048)}
    fused = {s: _row(report, "ort:ort-fused", s).latency.p50_ms for s in (128, 512, 2048)}
    int8 = _row(report, "ort:int8", 512).latency.p50_ms
    peak, ort_peak = report.peak_gflops["peak"], report.peak_gflops["onnxruntime"]
    best_2048 = max(_row(report, r, 2048).gflops for r in ("ort:fp32", "ort:ort-fused"))
    targets = [
        ("fp32 <= 0.45x eager at seq 512", f"{fp32[512] / eager[512]:.2f}x (ort-fused {fused[512] / eager[512]:.2f}x)"),
        (
            "fp32 <= 0.45x eager at seq 2048",
            f"{fp32[2048] / eager[2048]:.2f}x (ort-fused {fused[2048] / eager[2048]:.2f}x)",
        ),
        ("fp32 <= 0.9x eager at seq 128", f"{fp32[128] / eager[128]:.2f}x"),
        (
            ">= 90% of GEMM peak at (1, 2048)",
            f"{100 * best_2048 / peak:.0f}% of the best GEMM ({peak:.0f} GFLOP/s), "
            f"{100 * best_2048 / ort_peak:.0f}% of ONNX Runtime's own GEMM ({ort_peak:.0f})",
        ),
        ("int8 >= 1.6x fp32 at seq 512", f"{fp32[512] / int8:.2f}x"),
        ("bench model build (3 variants)", f"{build_s:.1f} s"),
        *(
            (f"zoo {k} (<= {'30' if 'cold' in k else '2' if 'unchanged' in k else '60'} s)", f"{v:.1f} s")
            for k, v in timings.items()
        ),
    ]
    print("\n| target | measured |\n|---|---|")
    for name, value in targets:
        print(f"| {name} | {value} |")
    if args.profile:
        shares = _profile(args.out / "mha_512.onnx", 512, threads)
        print("\nONNX Runtime fp32 at (1, 512), share of kernel time by op:")
        for op, share in shares.items():
            print(f"  {op:<12} {100 * share:5.1f}%")


if __name__ == "__main__":
    main()
