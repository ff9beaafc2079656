"""The bench pipeline: for each model, shape and runner (PyTorch eager, PyTorch SDPA,
optionally torch.compile, ONNX Runtime per variant), latency percentiles, throughput, the
ratio to eager, achieved GFLOP/s and its share of this machine's measured matmul peak, the
compile time apart, and peak memory per runner.

Results are plain dataclasses; ``report/bench_text.py`` and ``report/plot.py`` render them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from attn_export.artifacts.manifest import Manifest, load_manifest
from attn_export.artifacts.provenance import versions
from attn_export.errors import InputError
from attn_export.pipelines.bench.flops import count_flops, matmul_peak_gflops
from attn_export.pipelines.bench.results import BenchOptions, BenchReport, BenchRow
from attn_export.pipelines.bench.runners import (
    EAGER,
    graph_runners,
    machine_description,
    peak_memory,
    torch_runners,
)
from attn_export.pipelines.build import BuildOptions, BuildSummary, build_models
from attn_export.runtimes.timing import check_threads, measure, physical_cores
from attn_export.spec import ModelSpec, load_spec
from attn_export.spec.inputs import make_feeds
from attn_export.spec.memory import check_memory, memory_budget
from attn_export.spec.shapes import ShapePoint

__all__ = ["bench_models", "run_bench"]


def _sizes(spec: ModelSpec, batch: int, seq: int) -> dict[str, int]:
    if "batch" not in spec.dims:
        raise InputError(f"{spec.name}: bench needs a dim named 'batch' (dims: {', '.join(spec.dims)})")
    return {name: batch if name == "batch" else seq for name in spec.dims}


def run_bench(
    out_dir: Path,
    manifest: Manifest,
    specs: Sequence[ModelSpec],
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
) -> BenchReport:
    """Measure every requested runner at every shape; graphs come from ``out_dir``."""
    from attn_export.exporter.factory import instantiate

    check_threads(options.threads)
    threads = options.threads or physical_cores()
    options = dataclasses.replace(options, threads=threads)
    report = BenchReport(
        machine=machine_description(),
        versions=versions(),
        threads=threads,
        provider=options.provider,
        peak_gflops=matmul_peak_gflops(threads),
    )
    for spec in specs:
        module = instantiate(spec)
        runners, unavailable = torch_runners(spec, module, options)
        report.unavailable.update(unavailable)
        runners.update(graph_runners(out_dir, manifest, spec, options))
        for batch in options.batches:
            for seq in options.seqs:
                sizes = _sizes(spec, batch, seq)
                feeds = make_feeds(spec, sizes, 0)
                flops = count_flops(module, feeds)
                in_range = all(spec.dims[k].min <= v <= spec.dims[k].max for k, v in sizes.items())
                eager_p50: float | None = None
                for label, runner in runners.items():
                    with runner:
                        stats = measure(runner.prepare(feeds), budget_s=options.budget_s, warmup=2, min_repeats=3)
                    if label == EAGER:
                        eager_p50 = stats.p50_ms
                    gflops = flops / (stats.p50_ms / 1e3) / 1e9
                    row = BenchRow(
                        model=spec.name,
                        runner=label,
                        batch=batch,
                        seq=seq,
                        latency=stats,
                        flops=flops,
                        tokens_per_s=batch * seq / (stats.p50_ms / 1e3),
                        ratio_to_eager=stats.p50_ms / eager_p50 if eager_p50 else None,
                        gflops=gflops,
                        peak_share=gflops / report.peak_gflops["peak"],
                        in_verified_range=in_range,
                        compile_s=runner.compile_s,
                    )
                    report.rows.append(row)
                    if on_row:
                        on_row(row)
        if options.memory:
            largest = _sizes(spec, max(options.batches), max(options.seqs))
            report.memory_mb[spec.name] = peak_memory(out_dir, manifest, spec, options, largest)
    return report


def bench_models(
    spec_paths: Sequence[Path],
    out_dir: Path,
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
) -> tuple[BuildSummary, BenchReport | None]:
    """Build the variants still missing from ``out_dir``, then measure them; no report
    when a graph failed to build."""
    check_threads(options.threads)
    for path in spec_paths:
        spec = load_spec(path)
        points = [ShapePoint(f"batch {b}, seq {s}", _sizes(spec, b, s)) for b in options.batches for s in options.seqs]
        check_memory(spec, points, memory_budget(options.max_memory, spec))
    built = build_models(
        spec_paths, BuildOptions(out_dir, variants=tuple(dict.fromkeys(options.variants)), provider=options.provider)
    )
    if any(not r.ok for r in built.results):
        return built, None
    specs = [load_spec(p) for p in spec_paths]
    return built, run_bench(out_dir, load_manifest(out_dir), specs, options, on_row)
