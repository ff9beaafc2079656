"""Bench's cells: one model at one shape (prefill) or one batch and past (decode), every
runner timed there in alternating blocks, a pure function of a frozen input that returns
the shape's rows, so that an executor (``attn_export.executors``) may run it.

A cell holds every runner of its shape, not one runner each: a ratio to eager means
something only when both sides were timed in turns on the same cores at the same time.
Cells never run beside each other on one machine (``open_executor(..., exclusive=True)``):
locally one after another, on Ray one per node.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export.artifacts.manifest import Manifest
from attn_export.compare.latency import clearly_faster
from attn_export.errors import RuntimeFailure
from attn_export.executors import Parallelism, cell_key, run_in_order
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.inputs import make_feeds
from attn_export.pipelines.bench.flops import count_flops
from attn_export.pipelines.bench.physics import graph_weight_bytes, module_weight_bytes, outside_kernels, step_bytes
from attn_export.pipelines.bench.results import BenchOptions, BenchRow, DecodeBenchOptions, DecodeRow, RunnerOptions
from attn_export.pipelines.bench.runners import EAGER, graph_entries, graph_runners, torch_runners
from attn_export.runtimes import Runtime
from attn_export.runtimes.decoders import DecodeWindow
from attn_export.runtimes.ort import KIND as ORT_KIND
from attn_export.runtimes.timing import LatencyStats, measure_alternating

__all__ = ["DecodeCell", "PrefillCell", "decode_cell", "prefill_cell", "time_cells"]


@dataclass(frozen=True)
class PrefillCell:
    """One model at ``sizes`` (batch and seq), graphs from ``out_dir`` as ``manifest`` names them."""

    out_dir: Path
    manifest: Manifest
    spec: ModelSpec
    options: BenchOptions
    batch: int
    seq: int
    sizes: dict[str, int]
    #: This run's float32 GEMM peak (GFLOP/s), each row's share is taken of it.
    peak_gflops: float


@dataclass(frozen=True)
class DecodeCell:
    """One decoder at one batch and past: ``plan``'s window of steps of ``seq`` tokens each."""

    out_dir: Path
    manifest: Manifest
    spec: ModelSpec
    options: DecodeBenchOptions
    batch: int
    past: int
    seq: int
    #: The steps' feeds (``decode.plan_window``), made by the run so that every runner decodes the same.
    plan: DecodeWindow
    #: This run's copy bandwidth (bytes/s): each row's bandwidth limit is taken of it.
    copy_bandwidth: float


ORT_RUNTIME = ORT_KIND.name


@dataclass
class _Loaded:
    """A model's runners, kept by this process for the next cell of the same model: a
    compiled module keeps what it compiled, as it would for a user timing shape after shape."""

    key: str
    module: Any
    runners: dict[str, Runtime]
    unavailable: dict[str, str]


_LOADED: list[_Loaded] = []


def _loaded(out_dir: Path, manifest: Manifest, spec: ModelSpec, options: RunnerOptions) -> _Loaded:
    """This process's runners for the model (its PyTorch ones and each graph's), made anew
    when the model, its graphs or the options differ from the last cell's."""
    from attn_export.exporter.factory import instantiate

    graphs = {label: entry.sha256 for label, (_, entry) in graph_entries(manifest, spec, options).items()}
    key = cell_key("bench-runners", [spec.content_hash(), str(out_dir), graphs, dataclasses.asdict(options)])
    if not _LOADED or _LOADED[0].key != key:
        module = instantiate(spec)
        runners, unavailable = torch_runners(spec, module, options)
        runners.update(graph_runners(out_dir, manifest, spec, options))
        _LOADED[:] = [_Loaded(key, module, runners, unavailable)]
    return _LOADED[0]


@contextlib.contextmanager
def _naming(spec: ModelSpec, label: str) -> Iterator[None]:
    """A runner set up for timing that fails there (a Loop stopped at the run limit) says
    which model and runner in its one line."""
    try:
        yield
    except RuntimeFailure as e:
        raise RuntimeFailure(f"{spec.name} {label}: {e}") from e


def _verdict(row: LatencyStats, eager: LatencyStats) -> str:
    if clearly_faster(row, eager):
        return "faster"
    if clearly_faster(eager, row):
        return "slower"
    return "within noise"


def prefill_cell(cell: PrefillCell) -> tuple[list[BenchRow], dict[str, str]]:
    """Every runner at the cell's shape, timed in turns; rows in runner order, and the
    runners asked for that cannot run here, with why."""
    spec, options = cell.spec, cell.options
    loaded = _loaded(cell.out_dir, cell.manifest, spec, options)
    module, runners = loaded.module, loaded.runners
    feeds = make_feeds(spec, cell.sizes, 0)
    flops = count_flops(module, feeds)
    in_range = all(spec.dims[k].min <= v <= spec.dims[k].max for k, v in cell.sizes.items())
    with contextlib.ExitStack() as active:
        calls = {}
        for label, runner in runners.items():
            with _naming(spec, label):
                calls[label] = active.enter_context(runner).prepare(feeds)
        stats = measure_alternating(calls, budget_s=options.budget_s)
    eager = stats[EAGER].p50_ms
    rows = []
    for label, s in stats.items():
        gflops = flops / (s.p50_ms / 1e3) / 1e9
        rows.append(
            BenchRow(
                model=spec.name,
                runner=label,
                batch=cell.batch,
                seq=cell.seq,
                latency=s,
                flops=flops,
                tokens_per_s=cell.batch * cell.seq / (s.p50_ms / 1e3),
                ratio_to_eager=s.p50_ms / eager if eager > 0 else None,
                gflops=gflops,
                peak_share=gflops / cell.peak_gflops,
                in_verified_range=in_range,
                compile_s=runners[label].compile_s,
            )
        )
    return rows, loaded.unavailable


def decode_cell(cell: DecodeCell) -> tuple[list[DecodeRow], dict[str, str]]:
    """Every runner decoding the cell's window from the same prefilled cache, in turns; and
    the runners asked for that cannot run here, with why."""
    spec, options, plan = cell.spec, cell.options, cell.plan
    loaded = _loaded(cell.out_dir, cell.manifest, spec, options)
    module, runners = loaded.module, loaded.runners
    with contextlib.ExitStack() as active:
        decoders = {}
        for label, runner in runners.items():
            with _naming(spec, label):
                decoders[label] = active.enter_context(runner).decoder(plan)
        stats = measure_alternating({label: d.step for label, d in decoders.items()}, budget_s=options.budget_s)
        # proved after the timing, on one untimed window: a decoder with no buffer says None
        shared = {label: getattr(d, "shares_buffers", lambda: None)() for label, d in decoders.items()}
    graphs = {
        label: (name, cell.out_dir / entry.file)
        for label, (name, entry) in graph_entries(cell.manifest, spec, options).items()
    }
    weights = {label: module_weight_bytes(module) for label in runners if label not in graphs}  # PyTorch's
    weights |= {label: graph_weight_bytes(path) for label, (_, path) in graphs.items()}
    outside = {
        label: outside_kernels(path, runners[label], plan, options.provider, options.threads or 1)
        for label, (name, path) in graphs.items()
        if name == ORT_RUNTIME
    }
    base = stats[EAGER]
    tokens = cell.batch * cell.seq
    rows = []
    for label, s in stats.items():
        moved = step_bytes(plan, cell.seq, weights[label], in_place=bool(shared[label])).total
        rows.append(
            DecodeRow(
                model=spec.name,
                runner=label,
                batch=cell.batch,
                past=cell.past,
                window=len(plan.steps),
                latency=s,
                tokens_per_s=tokens * 1000 / s.p50_ms,
                ratio_to_eager=s.p50_ms / base.p50_ms if base.p50_ms > 0 else None,
                verdict=None if label == EAGER else _verdict(s, base),
                seq=cell.seq,
                scenario=options.scenario,
                bytes_per_token=moved / tokens,
                gbps=moved / (s.p50_ms / 1e3) / 1e9,
                limit_ratio=s.p50_ms / (moved / cell.copy_bandwidth * 1e3),
                outside_kernels=outside.get(label),
                shared_buffer=shared[label],
                compile_s=runners[label].compile_s,
            )
        )
    return rows, loaded.unavailable


def time_cells(
    report: Any,
    parallelism: Parallelism,
    fn: Callable[[Any], tuple[list[Any], dict[str, str]]],
    cells: Sequence[Any],
    on_row: Callable[[Any], None] | None,
) -> None:
    """Run ``fn`` on each cell (``executors.run_in_order``, exclusive: never two at once on one machine)
    and add its rows to ``report`` in cell order, each heard by ``on_row``, and the runners
    that could not run."""
    try:
        for rows, unavailable in run_in_order(parallelism, fn, cells, exclusive=True):
            report.unavailable.update(unavailable)
            for row in rows:
                report.rows.append(row)
                if on_row:
                    on_row(row)
    finally:
        _LOADED.clear()  # the last model's runners, where this process ran the cells
