"""The bench pipeline: for each model, shape and runner (PyTorch eager, PyTorch SDPA,
ONNX Runtime per variant), latency percentiles, throughput, the ratio to eager, achieved
GFLOP/s and its share of this machine's measured matmul peak, and peak memory per runner.

Results are plain dataclasses; ``report/bench_text.py`` and ``report/plot.py`` render them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from attn_export.artifacts.manifest import Manifest
from attn_export.artifacts.provenance import versions
from attn_export.errors import InputError
from attn_export.executors import SERIAL, Parallelism
from attn_export.model_spec import ModelSpec, load_spec
from attn_export.model_spec.cache import cache_of
from attn_export.model_spec.memory import check_memory, memory_budget
from attn_export.model_spec.shapes import ShapePoint
from attn_export.pipelines.bench.cells import PrefillCell, prefill_cell, time_cells
from attn_export.pipelines.bench.flops import matmul_peak_gflops
from attn_export.pipelines.bench.results import BenchOptions, BenchReport, BenchRow
from attn_export.pipelines.bench.runners import graph_notes, peak_memory, timing_machine
from attn_export.pipelines.bench.unbuilt import Left, build_for_bench, left_out_notes, without_left_out
from attn_export.pipelines.building import BuildSummary
from attn_export.runtimes.timing import check_threads, physical_cores

__all__ = ["bench_models", "run_bench"]


def _sizes(spec: ModelSpec, batch: int, seq: int) -> dict[str, int]:
    """The batch dim at ``batch``, every other free dim at ``seq``, a decoder's past at its
    least (a prompt, from the emptiest cache the spec allows), and the sums (``total_seq``)
    as they follow: set to ``seq`` too, a mask and its keys disagreed. The batch dim is
    ``batch``, or a decoder's cache's own (``CacheSpec.batch_dim``); a decoder without one
    runs at batch 1, any other spec must name one."""
    cache = cache_of(spec)
    batch_dim = "batch" if "batch" in spec.dims else cache.batch_dim if cache is not None else None
    if batch_dim is None and (cache is None or batch != 1):
        said = f"batch {batch} needs" if cache is not None else "bench needs"
        raise InputError(f"{spec.name}: {said} a dim named 'batch' (dims: {', '.join(spec.dims)})")
    sizes = {name: batch if name == batch_dim else seq for name in spec.free_dims}
    if cache is not None:
        sizes[cache.past_dim] = spec.dims[cache.past_dim].min
    return spec.with_sums(sizes)


def run_bench(
    out_dir: Path,
    manifest: Manifest,
    specs: Sequence[ModelSpec],
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
    parallelism: Parallelism = SERIAL,
    left: Left | None = None,
) -> BenchReport:
    """Measure every requested runner at every shape, but the runners ``left`` out (said
    why, ``bench.unbuilt``); graphs come from ``out_dir``. Each model x shape is a cell
    (``cells.prefill_cell``) on ``parallelism``'s executor, never beside another on one
    machine; rows come in model, batch, seq order whichever ran them."""
    left = left or {}
    check_threads(options.threads)
    threads = options.threads or physical_cores()
    options = dataclasses.replace(options, threads=threads)
    report = BenchReport(
        machine=timing_machine(),
        versions=versions(),
        threads=threads,
        provider=options.provider,
        peak_gflops=matmul_peak_gflops(threads),
        unavailable=left_out_notes(left),
    )
    per_model = {spec.name: without_left_out(options, spec.name, left) for spec in specs}
    for spec in specs:
        report.graph_notes.update(graph_notes(manifest, spec, per_model[spec.name]))
    cells = [
        PrefillCell(out_dir, manifest, spec, per_model[spec.name], b, s, _sizes(spec, b, s), report.peak_gflops["peak"])
        for spec in specs
        for b in options.batches
        for s in options.seqs
    ]
    time_cells(report, parallelism, prefill_cell, cells, on_row)
    for spec in specs if options.memory else []:
        largest = _sizes(spec, max(options.batches), max(options.seqs))
        report.memory_mb[spec.name] = peak_memory(out_dir, manifest, spec, per_model[spec.name], largest)
    return report


def bench_models(
    spec_paths: Sequence[Path],
    out_dir: Path,
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
    parallelism: Parallelism = SERIAL,
) -> tuple[BuildSummary, BenchReport | None]:
    """Build the variants still missing from ``out_dir``, then measure them; no report
    when a graph failed to build, but an optional one (``bench.unbuilt``)."""
    check_threads(options.threads)
    parallelism.check_exclusive()
    for path in spec_paths:
        spec = load_spec(path)
        points = [ShapePoint(f"batch {b}, seq {s}", _sizes(spec, b, s)) for b in options.batches for s in options.seqs]
        check_memory(spec, points, memory_budget(options.max_memory, spec))
    specs = [load_spec(p) for p in spec_paths]
    built, ready = build_for_bench(spec_paths, out_dir, specs, options)
    if ready is None:
        return built, None
    manifest, left = ready
    return built, run_bench(out_dir, manifest, specs, options, on_row, parallelism, left)
