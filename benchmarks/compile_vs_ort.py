"""PyTorch's own compiler against ONNX Runtime on CPU: torch.compile (Inductor) beside
PyTorch eager and ONNX Runtime, prefill and decode, with the spread across repeats.

    python benchmarks/compile_vs_ort.py              # about ten minutes on 2 cores
    python benchmarks/compile_vs_ort.py --repeats 5  # more repeats, a tighter spread

Builds (in a temporary folder) the seed MultiHeadAttention at hidden 512, 8 heads
(``benchmarks/models/mha_512.toml``, variants fp32, ort-fused, int8) and its decoding step
with a key/value cache (``benchmarks/models/mha_kv_cache_512.toml``, variants fp32,
attention-op, ort-past, int8; and the same declared at batch 1 with a capacity,
``mha_kv_cache_512_one_stream.toml``, its cache updated in place: static-cache,
static-cache+int8), then times, at batch 1:

* prefill at seq 128, 512 and 2048: PyTorch eager, PyTorch SDPA, ``torch.compile(module,
  dynamic=True)`` and ONNX Runtime per variant, each call on inputs already in place;
* decode at past 128, 512 and 2048: one step (seq 1) of eager with its cache, of the
  compiled module with its cache, and of ONNX Runtime per variant with inputs and outputs
  bound, each feeding its presents back over a window of 8 steps (as ``bench --decode``).

Every runner of a table takes turns with the others in alternating blocks
(``runtimes.timing.measure_alternating``), with the same threads, ONNX Runtime's idle
threads not spinning; that is one repeat, and ``--repeats`` of them are run. A cell is the
median over the repeats of each repeat's p50, with the lowest and highest in brackets; a
ratio is the median of the repeats' ratios, with theirs. Compile times are the one-off
seconds of the first calls (``bench --compile``), with Inductor's on-disk cache empty
(a fresh ``TORCHINDUCTOR_CACHE_DIR``): what a first deployment pays. Nothing here
asserts: figures are printed, from one run of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from repeats import heading, repeated, spread, started, timing_arguments  # benchmarks/repeats.py, next to this script

from attn_export.pipelines.bench.runners import COMPILED

HERE = Path(__file__).resolve().parent
PREFILL_SPEC = HERE / "models" / "mha_512.toml"
DECODE_SPEC = HERE / "models" / "mha_kv_cache_512.toml"
#: The decoder at batch 1 with a capacity: its cache updated in place.
ONE_STREAM = HERE / "models" / "mha_kv_cache_512_one_stream.toml"
PREFILL_VARIANTS = ("fp32", "ort-fused", "int8")
DECODE_VARIANTS = ("fp32", "attention-op", "ort-past", "int8")
IN_PLACE = ("static-cache", "static-cache+int8")
SIZES = (128, 512, 2048)


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def table(kind: str, p50s: Mapping[int, Mapping[str, list[float]]]) -> str:
    """Markdown: a row per runner, per size its median p50 and its ratio to torch.compile."""
    sizes = list(p50s)
    head = " | ".join(f"{kind} {s} p50 (ms) | vs compile" for s in sizes)
    lines = [f"| runner | {head} |", "|---|" + "---:|---:|" * len(sizes)]
    for label in p50s[sizes[0]]:
        cells = []
        for s in sizes:
            mine, compiled = p50s[s][label], p50s[s].get(COMPILED)
            ratios = [m / c for m, c in zip(mine, compiled, strict=True)] if compiled else []
            cells += [spread(mine, ".3f"), spread(ratios, ".2f", "x") if ratios else "-"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prefill_calls(spec_of: Mapping[str, Any], runners: Mapping[str, Any], seq: int) -> dict[str, Callable[[], object]]:
    """Each runner's call on the same feeds at batch 1, ``seq``."""
    from attn_export.model_spec.inputs import make_feeds

    return {
        label: runner.prepare(make_feeds(spec_of[label], {"batch": 1, "seq": seq}, 0))
        for label, runner in runners.items()
    }


def decode_calls(spec_of: Mapping[str, Any], runners: Mapping[str, Any], past: int) -> dict[str, Callable[[], object]]:
    """Each runner's decode step over a window of 8 steps from ``past``, planned from its
    own spec with one seed."""
    from attn_export.pipelines.bench.decode_timing import plan_window

    return {label: runner.decoder(plan_window(spec_of[label], 1, past, 8, 0)).step for label, runner in runners.items()}


def timed(
    out: Path,
    specs: list[tuple[Path, Any]],
    repeats: int,
    calls: Callable[..., dict[str, Callable[[], object]]],
) -> tuple[dict[int, dict[str, list[float]]], dict[int, float]]:
    """Per size, each runner's p50s over the repeats, and the seconds torch.compile spent
    compiling before timing. The first of ``specs`` (a spec file and its options) gives
    PyTorch's runners and its graphs', each other its graphs' (the same module declared
    otherwise); ``calls(spec_of, runners, size)`` gives each runner's call, ``spec_of`` its
    runner's spec."""
    from attn_export.artifacts.manifest import load_manifest
    from attn_export.exporter.factory import instantiate
    from attn_export.model_spec import load_spec
    from attn_export.pipelines.bench.runners import graph_runners, torch_runners

    manifest = load_manifest(out)
    first = load_spec(specs[0][0])
    runners, _ = torch_runners(first, instantiate(first), specs[0][1])
    spec_of = dict.fromkeys(runners, first)
    for path, options in specs:
        spec = load_spec(path)
        graphs = graph_runners(out, manifest, spec, options)
        runners.update(graphs)
        spec_of.update(dict.fromkeys(graphs, spec))
    p50s, compile_s = {}, {}
    with contextlib.ExitStack() as active:
        for runner in runners.values():
            active.enter_context(runner)
        for size in SIZES:
            at = calls(spec_of, runners, size)
            compile_s[size] = runners[COMPILED].compile_s or 0.0
            p50s[size] = repeated(at, repeats, options.budget_s)
    return p50s, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    timing_arguments(
        parser,
        repeats="rounds of alternating blocks per size",
        budget="seconds of timed calls per runner, size and repeat",
        threads="prefill threads on every side (default: the physical cores)",
    )
    parser.add_argument(
        "--decode-threads",
        type=int,
        default=1,
        help="decode threads on every side (default 1, as benchmarks/decode_perf.py: a batch-1 step is a few small "
        "GEMVs, which more threads on a shared machine only slow down)",
    )
    args = parser.parse_args()
    command, threads = started(parser, args, "compile_vs_ort.py", decode_threads=args.decode_threads)

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # cold: nothing compiled before

        from attn_export.artifacts.provenance import versions
        from attn_export.pipelines.bench.results import BenchOptions, DecodeBenchOptions
        from attn_export.pipelines.bench.runners import timing_machine
        from attn_export.pipelines.building import BuildOptions, build_models
        from attn_export.runtimes.timing import load_average

        load_start = load_average()
        out = Path(tmp) / "build"
        t0 = time.perf_counter()
        builds = ((PREFILL_SPEC, PREFILL_VARIANTS), (DECODE_SPEC, DECODE_VARIANTS), (ONE_STREAM, IN_PLACE))
        for spec, variants in builds:
            built = build_models([spec], BuildOptions(out, variants=variants))
            assert all(r.ok for r in built.results), [r.error for r in built.results]
        build_s = time.perf_counter() - t0
        shared = {"budget_s": args.budget, "torch_compile": True}
        prefill_options = BenchOptions(variants=PREFILL_VARIANTS, threads=threads, **shared)
        prefill_p50s, prefill_compile = timed(out, [(PREFILL_SPEC, prefill_options)], args.repeats, prefill_calls)
        decode_options = DecodeBenchOptions(variants=DECODE_VARIANTS, threads=args.decode_threads, **shared)
        in_place = DecodeBenchOptions(variants=IN_PLACE, threads=args.decode_threads, **shared)
        decode = [(DECODE_SPEC, decode_options), (ONE_STREAM, in_place)]
        decode_p50s, decode_compile = timed(out, decode, args.repeats, decode_calls)

    load_end = load_average()
    print(heading(command, timing_machine(), versions()))
    print(
        f"load average {load_start:.2f} at the start, {load_end:.2f} at the end; build {build_s:.1f} s; "
        f"{args.repeats} repeats of alternating blocks, {args.budget:g} s per runner, size and repeat\n"
    )
    print(f"Prefill, batch 1, {_threads(threads)} on every side; p50 (ms), median [lowest–highest] over the repeats:\n")
    print(table("seq", prefill_p50s))
    print(
        f"\n{COMPILED} compile (cold Inductor cache, once, not in the latency): "
        + ", ".join(f"seq {s} {v:.2f} s" for s, v in prefill_compile.items())
    )
    print(
        f"\nDecode (one token, a window of 8 steps from the past), batch 1, {_threads(args.decode_threads)} on "
        "every side; p50 ms per step, median [lowest–highest] over the repeats:\n"
    )
    print(table("past", decode_p50s))
    print(
        f"\n{COMPILED} compile (cold Inductor cache, once, not in the latency): "
        + ", ".join(f"past {p} {v:.2f} s" for p, v in decode_compile.items())
    )


if __name__ == "__main__":
    main()
