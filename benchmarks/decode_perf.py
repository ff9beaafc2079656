"""Per-token decode latency of a KV-cache decoder against PyTorch eager and against this
machine's memory bandwidth.

    python benchmarks/decode_perf.py             # about two minutes on 2 cores (most of it the build)
    python benchmarks/decode_perf.py --profile   # always print ONNX Runtime's breakdown by op

Builds (in a temporary folder) the seed MultiHeadAttention at hidden 512, 8 heads as a
decoding step with a key/value cache (``benchmarks/models/mha_kv_cache_512.toml``, past up
to 4096) with the fp32, attention-op, ort-past, ort-fused and int8 variants, and the same
model at batch 1 with a capacity (``mha_kv_cache_512_one_stream.toml``) with the cache
updated in place (static-cache, static-cache+int8), runs ``bench --decode`` at batch 1 and
past 128, 512 and 2048, and prints at past 512:

* the best ONNX Runtime variant's per-token latency against PyTorch eager with its cache
  (target <= 0.5x);
* the memory-bandwidth limit: the bytes one step moves (the graph's weights, the cache read
  and the presents written: ``attn_export.pipelines.bench.physics``) over this machine's copy
  bandwidth, measured in the same run with a large numpy copy, and the measured latency
  against that limit (target within 2x).

Where a target is missed it says why, with ONNX Runtime's profile of the timed (bound)
path broken down by op type. Nothing here asserts: figures are printed, from one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SPEC = HERE / "models" / "mha_kv_cache_512.toml"
#: The same model at batch 1 with a declared capacity: the cache updated in place.
ONE_STREAM = HERE / "models" / "mha_kv_cache_512_one_stream.toml"
PASTS = (128, 512, 2048)
AT = 512
VARIANTS = ("fp32", "attention-op", "ort-past", "ort-fused", "int8")
IN_PLACE = ("static-cache", "static-cache+int8")


def last_level_cache() -> str:
    """The largest CPU cache this machine reports, e.g. '32768K', or '?'."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in sorted(base.glob("index*")):
        try:
            sizes.append(((index / "level").read_text().strip(), (index / "size").read_text().strip()))
        except OSError:
            continue
    return max(sizes)[1] if sizes else "?"


def profile_bound_steps(
    model: Path, spec: Any, threads: int, steps: int = 200
) -> tuple[dict[str, float], float, float, float]:
    """ONNX Runtime's profile of the timed path (IOBinding, presents fed back or the buffer
    written in place) at past ``AT``: share of kernel time per op type, mean ms per run,
    mean ms in kernels per run, and nodes run per step."""
    from attn_export.pipelines.bench.decode import plan_window
    from attn_export.pipelines.bench.physics import profile_steps
    from attn_export.runtimes.ort import OnnxRuntime

    runtime = OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, threads=threads, capacity=spec.cache_max_seq)
    with runtime:
        profile = profile_steps(model, runtime, plan_window(spec, 1, AT, 8, 0), "cpu", threads, steps)
    kernels = sum(profile.kernel_us.values())
    shares = {op: us / kernels for op, us in sorted(profile.kernel_us.items(), key=lambda kv: -kv[1])}
    return shares, profile.run_us / profile.runs / 1e3, kernels / profile.runs / 1e3, profile.nodes / profile.runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed steps per runner and past length")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads on both sides (default 1: a batch-1 step is a few small GEMVs, and on a shared 2-core "
        "machine PyTorch's OpenMP threads wait on a busy core and run 10x slower with 2)",
    )
    parser.add_argument("--profile", action="store_true", help="print the profile even when every target is met")
    args = parser.parse_args()

    from attn_export.artifacts.manifest import load_manifest
    from attn_export.compare.latency import noise
    from attn_export.pipelines.bench.decode import run_decode_bench
    from attn_export.pipelines.bench.results import DecodeBenchOptions
    from attn_export.pipelines.build import BuildOptions, build_models
    from attn_export.report.bench_text import format_decode_summary, markdown_decode_table
    from attn_export.spec import load_spec, variant_key

    command = " ".join(["python", "benchmarks/decode_perf.py", *sys.argv[1:]])
    spec, one_stream = load_spec(SPEC), load_spec(ONE_STREAM)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        built = build_models([SPEC], BuildOptions(out, variants=VARIANTS))
        built.results += build_models([ONE_STREAM], BuildOptions(out, variants=IN_PLACE)).results
        assert all(r.ok for r in built.results), [r.error for r in built.results]
        build_s = time.perf_counter() - t0
        manifest = load_manifest(out)

        def bench(model: Any, variants: tuple[str, ...]) -> Any:
            options = DecodeBenchOptions(
                batches=[1], pasts=PASTS, variants=variants, threads=args.threads, budget_s=args.budget
            )
            return run_decode_bench(out, manifest, [model], options)

        report = bench(spec, VARIANTS)
        report.rows += bench(one_stream, IN_PLACE).rows  # each cell timed against its own eager, in turns
        files = {v: out / manifest.models[variant_key(spec.name, v)].file for v in VARIANTS}
        files |= {v: out / manifest.models[variant_key(one_stream.name, v)].file for v in IN_PLACE}
        bandwidth = (report.copy_gbps or float("nan")) * 1e9

        rows: dict[str, Any] = {}
        for r in report.rows:
            if r.past == AT:
                rows.setdefault(r.runner, r)  # the first eager: the batch-dim model's
        eager = rows["torch-eager"]
        best = min((r for r in rows.values() if r.runner != "torch-eager"), key=lambda r: r.latency.p50_ms)
        variant = best.runner.removeprefix("ort:")
        assert best.limit_ratio is not None and best.bytes_per_token is not None
        moved = best.bytes_per_token  # batch 1, one token per step: the bytes of a step
        limit_ms = best.latency.p50_ms / best.limit_ratio
        vs_eager = best.latency.p50_ms / eager.latency.p50_ms
        vs_limit = best.latency.p50_ms / limit_ms
        flags = [f for f in (noise(best.latency, eager.latency),) if f]

        print(f"Measured {datetime.date.today().isoformat()} on {report.machine} with `{command}`")
        print(", ".join(f"{k} {v}" for k, v in report.versions.items()))
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"threads {report.threads} on both sides; load average at the end {load:.2f}; build {build_s:.1f} s\n")
        print(markdown_decode_table(report))
        print(format_decode_summary(report))
        print(f"\nAt past {AT}, batch 1:")
        print(
            f"  PyTorch eager      {eager.latency.p50_ms:.3f} ms/token (p90 {eager.latency.p90_ms:.3f}), "
            f"{eager.tokens_per_s:.0f} tokens/s"
        )
        print(
            f"  best ORT: {variant:<8} {best.latency.p50_ms:.3f} ms/token (p90 {best.latency.p90_ms:.3f}), "
            f"{best.tokens_per_s:.0f} tokens/s"
        )
        print(f"  copy bandwidth     {bandwidth / 1e9:.2f} GB/s (numpy copy of 256 MiB, read + written, 1 thread)")
        print(
            f"  bytes per token    {moved / 2**20:.2f} MiB ({variant}: weights, the cache read and the presents "
            "written)"
        )
        print(f"  bandwidth limit    {limit_ms:.3f} ms/token; largest CPU cache {last_level_cache()}")
        for v in VARIANTS + IN_PLACE:  # each variant against the limit of its own bytes
            row = rows[f"ort:{v}"]
            outside = "-" if row.outside_kernels is None else f"{100 * row.outside_kernels:.0f}%"
            print(
                f"  ort:{v:<10}      {row.latency.p50_ms:.3f} ms/token, {row.gbps or 0:.1f} GB/s, "
                f"{row.limit_ratio or 0:.2f}x its limit, {outside} outside kernels"
            )
        eager_met = vs_eager <= 0.5
        beyond = best.latency.p90_ms <= 0.5 * eager.latency.p50_ms
        limit_met = vs_limit <= 2
        print("\n| target | measured | met |\n|---|---|---|")
        print(
            f"| best ORT <= 0.5x eager at past {AT} | {vs_eager:.2f}x ({variant}) | "
            f"{'yes' if eager_met and beyond else 'yes at p50, inside the noise' if eager_met else 'no'} |"
        )
        print(f"| within 2x of the bandwidth limit at past {AT} | {vs_limit:.2f}x | {'yes' if limit_met else 'no'} |")
        if flags:
            print(f"\nnote: {flags[0]} (the machine is shared; the ratios are from this one run)")
        if vs_limit < 1:
            print(
                f"\nnote: faster than the limit: the {moved / 2**20:.1f} MiB a step moves stay in the CPU's caches "
                "between steps, so DRAM bandwidth does not bound this size; the limit is a ceiling only past them."
            )
        if not (eager_met and limit_met) or args.profile:
            model = one_stream if variant in IN_PLACE else spec
            shares, run_ms, kernel_ms, nodes = profile_bound_steps(files[variant], model, report.threads)
            print(
                f"\nONNX Runtime {variant}, bound decode steps at past {AT} (enable_profiling, which slows each "
                f"node: {run_ms:.3f} ms per run here against {best.latency.p50_ms:.3f} timed): {nodes:.0f} nodes per "
                f"step, {100 * kernel_ms / run_ms:.0f}% of a run in kernels; share of kernel time by op type:"
            )
            for op, share in shares.items():
                if share >= 0.005:
                    print(f"  {op:<22} {100 * share:5.1f}%")
            if not eager_met:
                top = next(iter(shares), "?")
                print(
                    f"why not <= 0.5x eager: {top} takes {100 * shares.get(top, 0):.0f}% of ONNX Runtime's kernel time "
                    f"and {100 - 100 * kernel_ms / run_ms:.0f}% of a run is outside kernels"
                )
            if not limit_met:
                heavy = ("Concat", "Softmax", "Attention", "GroupQueryAttention", "MultiHeadAttention")
                small = sum(v for op, v in shares.items() if op not in heavy and "MatMul" not in op)
                print(
                    "why not within 2x: the limit counts each byte once, at copy speed, and a step runs "
                    f"{nodes:.0f} nodes of which the ones that are neither attention, MatMul, Softmax nor Concat "
                    f"(mask, shape, layout and quantization ops) take {100 * small:.0f}% of kernel time and move "
                    f"almost no bytes, and spends {100 - 100 * kernel_ms / run_ms:.0f}% of a run outside kernels "
                    "(per-run and per-node overhead)."
                )


if __name__ == "__main__":
    main()
