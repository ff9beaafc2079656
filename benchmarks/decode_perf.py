"""Per-token decode latency of a KV-cache decoder against PyTorch eager and against this
machine's memory bandwidth.

    python benchmarks/decode_perf.py             # about three minutes on 2 cores
    python benchmarks/decode_perf.py --profile   # print ONNX Runtime's breakdown for every target

Builds (in a temporary folder) the seed MultiHeadAttention at hidden 512, 8 heads as a
decoding step with a key/value cache (``benchmarks/models/mha_kv_cache_512.toml``, past up
to 4096) with the fp32, attention-op, ort-past, ort-fused and int8 variants, and the same
model at batch 1 with a capacity (``mha_kv_cache_512_one_stream.toml``) with the cache
updated in place (static-cache, static-cache+int8), runs ``bench --decode`` at batch 1 and
past 128, 512 and 2048, and prints each runner's per-token latency against PyTorch eager
with its cache and against its memory-bandwidth limit (the bytes one step moves: weights,
cache read and presents written, ``attn_export.pipelines.bench.physics``, over this
machine's copy bandwidth measured in the same run), and the targets: at past 512 the best
float32 variant within 1.2x of its limit and at most 0.3x eager, at past 2048 at most 0.4x
eager, the best int8 chain within 2x of its limit, and eager stable to 15% across the runs
(``host_speed.py`` shows whether the host itself is).

The whole bench runs ``--repeats`` times (default 3): figures are medians, and eager's spread
across the runs is printed. The in-place variants are timed in turns with the batch-1
model's eager, the others with the reference model's: the same module, whose two figures
can differ by a quarter, so every ratio to eager is taken against the faster of the two in
its run. Where a target is missed, ONNX Runtime's profile of the timed
(bound) path of that variant at that target's past is broken down by op type, with each
op's time per step and, for the ops that read the cache or the weights, the bandwidth they
achieve: a step far from its limit shows there whether its time goes to moving bytes or to
a kernel. Nothing here asserts: figures are printed.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from repeats import float32_exact, spread  # benchmarks/repeats.py, next to this script

from attn_export.runtimes.allocator import keep_freed_memory
from attn_export.runtimes.timing import load_average

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


#: A fused attention op reads the whole cache, and where one is present the matrix
#: products left read the weights alone: each one's profiled kernel time over those bytes
#: is its achieved bandwidth. Without one, attention is MatMuls over the cache too, and
#: nothing is attributed.
CACHE_OPS = ("GroupQueryAttention", "Attention", "MultiHeadAttention")
WEIGHT_OPS = ("MatMul", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits", "Gemm")


def profile_bound_steps(model: Path, spec: Any, threads: int, past: int, in_place: bool, steps: int = 200) -> str:
    """ONNX Runtime's profile of the timed path (IOBinding, presents fed back or the buffer
    written in place) at ``past``, as lines: ms per run and in kernels, nodes per step, and
    each op type's share of kernel time with its ms per step. The ops that read the cache
    and those that read the weights also get their achieved bandwidth (bytes over kernel
    time), which says whether a step's remainder lies in moving bytes or in a kernel."""
    from attn_export.pipelines.bench.decode_timing import plan_window
    from attn_export.pipelines.bench.physics import graph_weight_bytes, profile_steps, step_bytes
    from attn_export.runtimes.ort import OnnxRuntime

    plan = plan_window(spec, 1, past, 8, 0)
    runtime = OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, threads=threads, capacity=spec.cache_max_seq)
    with runtime:
        profile = profile_steps(model, runtime, plan, "cpu", threads, steps)
    moved = step_bytes(plan, 1, graph_weight_bytes(model), in_place)
    runs, kernels = profile.runs, sum(profile.kernel_us.values())
    lines = [
        f"{profile.run_us / runs / 1e3:.3f} ms per profiled run (profiling slows each node), "
        f"{100 * kernels / profile.run_us:.0f}% in kernels, {profile.nodes / runs:.0f} nodes per step; "
        f"bytes per step: weights {moved.weights / 1e6:.2f} MB, cache read {moved.cache_read / 1e6:.2f} MB, "
        f"written {moved.cache_written / 1e6:.2f} MB; by op type:"
    ]
    fused = [op for op in profile.kernel_us if op in CACHE_OPS]
    for op, share in profile.shares().items():
        if share < 0.005:
            continue
        ms = profile.kernel_us[op] / runs / 1e3
        nbytes = 0
        if len(fused) == 1:
            nbytes = moved.cache_read + moved.cache_written if op in fused else moved.weights if op in WEIGHT_OPS else 0
        speed = f", {nbytes / ms / 1e6:.1f} GB/s over the {'cache' if op in CACHE_OPS else 'weights'}" if nbytes else ""
        lines.append(f"  {op:<22} {100 * share:5.1f}%  {ms:.3f} ms{speed}")
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed steps per runner and past length")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads on both sides (default 1: a batch-1 step is a few small GEMVs, and on a shared 2-core "
        "machine PyTorch's OpenMP threads wait on a busy core and run 10x slower with 2)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="whole bench runs; figures are their medians")
    parser.add_argument("--profile", action="store_true", help="print the profile even when every target is met")
    args = parser.parse_args()
    keep_freed_memory()  # before the builds fill the heap: the timed steps then never page-fault

    from attn_export.artifacts.manifest import load_manifest
    from attn_export.model_spec import load_spec, variant_key
    from attn_export.pipelines.bench.decode_timing import run_decode_bench
    from attn_export.pipelines.bench.results import DecodeBenchOptions
    from attn_export.pipelines.building import BuildOptions, build_models
    from attn_export.report.bench_text import format_decode_summary, markdown_decode_table

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

        reports = []
        for _ in range(args.repeats):
            report = bench(spec, VARIANTS)
            report.rows += bench(one_stream, IN_PLACE).rows  # each cell timed against its own eager, in turns
            reports.append(report)
        files = {v: out / manifest.models[variant_key(spec.name, v)].file for v in VARIANTS}
        files |= {v: out / manifest.models[variant_key(one_stream.name, v)].file for v in IN_PLACE}

        # Per runner and past, over the repeats: its p50, its ratio to its limit, and its ratio
        # to eager. The batch-1 model's eager is timed in turns with the in-place variants, the
        # reference model's with the others; the same module, but they can differ by a quarter.
        # A ratio is taken against the faster of the two in its run, so that neither flatters
        # it, and the variant's time at its limit (its floor) against the same eager.
        p50: dict[tuple[str, int], list[float]] = defaultdict(list)
        limit: dict[tuple[str, int], list[float]] = defaultdict(list)
        to_eager: dict[tuple[str, int], list[float]] = defaultdict(list)
        floor: dict[tuple[str, int], list[float]] = defaultdict(list)
        for report in reports:
            eager_of = {(r.model, r.past): r.latency.p50_ms for r in report.rows if r.runner == "torch-eager"}
            for r in report.rows:
                own = r.runner == "torch-eager" and r.model == one_stream.name
                key = ("torch-eager (batch-1 model)" if own else r.runner, r.past)
                eager = min(eager_of[(m.name, r.past)] for m in (spec, one_stream))
                p50[key].append(r.latency.p50_ms)
                to_eager[key].append(r.latency.p50_ms / eager)
                if r.limit_ratio:
                    limit[key].append(r.limit_ratio)
                    floor[key].append(r.latency.p50_ms / r.limit_ratio / eager)
        ms = {k: _median(v) for k, v in p50.items()}
        vs_limit = {k: _median(v) for k, v in limit.items()}
        vs_eager = {k: _median(v) for k, v in to_eager.items()}

        def best(variants: tuple[str, ...], past: int, by: dict[tuple[str, int], float]) -> str:
            return min(variants, key=lambda v: by[(f"ort:{v}", past)])

        fp32_variants = tuple(v for v in VARIANTS + IN_PLACE if float32_exact(v))
        int8_variants = tuple(v for v in VARIANTS + IN_PLACE if not float32_exact(v))
        first = reports[0]
        print(f"Measured {datetime.date.today().isoformat()} on {first.machine} with `{command}`")
        print(", ".join(f"{k} {v}" for k, v in first.versions.items()))
        load = load_average() or float("nan")
        print(
            f"threads {first.threads} on both sides; {args.repeats} runs; load average at the end {load:.2f}; "
            f"build {build_s:.1f} s; copy bandwidth "
            + ", ".join(f"{r.copy_gbps or 0:.1f}" for r in reports)
            + f" GB/s; largest CPU cache {last_level_cache()}\n"
        )
        print("The first run's table:\n")
        print(markdown_decode_table(first))
        print(format_decode_summary(first))
        print(
            f"\nMedian p50 over {args.repeats} runs (ms/token), its ratio to eager (the faster of the two models' "
            "eager in each run) and to its bandwidth limit:\n"
        )
        print("| runner | " + " | ".join(f"past {p}" for p in PASTS) + " |")
        print("|---|" + "---:|" * len(PASTS))
        for runner in dict.fromkeys(r for r, _ in ms):
            cells = [
                f"{ms[(runner, p)]:.3f} ({vs_eager[(runner, p)]:.2f}x eager, "
                f"{vs_limit.get((runner, p), float('nan')):.2f}x limit)"
                for p in PASTS
            ]
            print(f"| {runner} | " + " | ".join(cells) + " |")

        def farthest(values: list[float]) -> float:
            """+-x: the farthest run from the median, as a share of it (nan without runs)."""
            return max((abs(v / _median(values) - 1) for v in values), default=float("nan"))

        # the batch-dim model's eager; its ratio to its limit is its time over the run's copy
        # bandwidth: the host's own speed taken out
        spread_of = {p: farthest(p50[("torch-eager", p)]) for p in PASTS}
        at_speed = {p: farthest(limit[("torch-eager", p)]) for p in PASTS}
        print(
            "\neager's p50 across the runs: "
            + "; ".join(
                f"past {p}: {', '.join(f'{x:.3f}' for x in p50[('torch-eager', p)])} ms "
                f"(+-{100 * spread_of[p]:.0f}% of the median; over its bandwidth limit, which takes the run's "
                f"copy bandwidth out, +-{100 * at_speed[p]:.0f}%)"
                for p in PASTS
            )
        )

        fp32_limit, int8_limit = best(fp32_variants, AT, vs_limit), best(int8_variants, AT, vs_limit)
        fp32_512, fp32_2048 = best(fp32_variants, AT, vs_eager), best(fp32_variants, 2048, vs_eager)

        # Each target: its name, the figure per run, the bound, whose figure it is and at what past.
        targets = [
            (
                f"best fp32 variant <= 1.2x its bandwidth limit at past {AT}",
                limit[(f"ort:{fp32_limit}", AT)],
                1.2,
                fp32_limit,
                AT,
            ),
            (f"best fp32 variant <= 0.3x eager at past {AT}", to_eager[(f"ort:{fp32_512}", AT)], 0.3, fp32_512, AT),
            (
                "best fp32 variant <= 0.4x eager at past 2048",
                to_eager[(f"ort:{fp32_2048}", 2048)],
                0.4,
                fp32_2048,
                2048,
            ),
            (
                f"best int8 chain <= 2x the int8 limit at past {AT}",
                limit[(f"ort:{int8_limit}", AT)],
                2.0,
                int8_limit,
                AT,
            ),
        ]
        # A ratio to eager has a floor: the variant's own bandwidth limit over eager's time. A
        # target under it asks the step to move its bytes faster than this machine copies.
        floors = {name: _median(floor[(f"ort:{who}", past)]) for name, _, _, who, past in targets[1:3]}
        print(
            "\n| target | measured: median [lowest–highest] over the runs | met | at its bandwidth limit |"
            "\n|---|---|---|---|"
        )
        for name, runs, bound, who, _ in targets:
            at_limit = f"{floors[name]:.2f}x eager" if name in floors else ""
            met = "yes" if _median(runs) <= bound else "no"
            print(f"| {name} | {spread(runs, '.2f')} ({who}) | {met} | {at_limit} |")
        worst = max(spread_of.values())
        print(
            f"| eager stable to +-15% across the runs (worst past) | +-{100 * worst:.0f}% "
            f"(over its limit: +-{100 * max(at_speed.values()):.0f}%) | {'yes' if worst <= 0.15 else 'no'} | |"
        )
        print(
            "\n(at its bandwidth limit: the time the variant's bytes take at the measured copy bandwidth, over "
            "eager's; a target below it can be met only where the bytes stay in the CPU's caches)"
        )
        if worst > 0.15:
            print(
                "(eager moved more than +-15%: `python benchmarks/host_speed.py` times the same work block after "
                "block, and shows how much this host moves by itself)"
            )
        missed = [(who, past) for _, runs, bound, who, past in targets if _median(runs) > bound]
        shown = missed if not args.profile else [(who, past) for _, _, _, who, past in targets]
        copy = _median([r.copy_gbps or 0 for r in reports])
        for variant, past in dict.fromkeys(shown):
            model = one_stream if variant in IN_PLACE else spec
            print(
                f"\nONNX Runtime {variant}, bound decode steps at past {past} ({ms[(f'ort:{variant}', past)]:.3f} ms "
                f"timed; copy bandwidth {copy:.1f} GB/s): "
                + profile_bound_steps(files[variant], model, first.threads, past, variant in IN_PLACE)
            )


if __name__ == "__main__":
    main()
