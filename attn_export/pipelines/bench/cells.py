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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export.artifacts.manifest import Manifest
from attn_export.compare.latency import clearly_faster
from attn_export.pipelines.bench.flops import count_flops
from attn_export.pipelines.bench.physics import graph_weight_bytes, module_weight_bytes, outside_kernels, step_bytes
from attn_export.pipelines.bench.results import BenchOptions, BenchRow, DecodeBenchOptions, DecodeRow
from attn_export.pipelines.bench.runners import EAGER, graph_entries, graph_runners
from attn_export.runtimes import Runtime
from attn_export.runtimes.decoders import DecodeWindow
from attn_export.runtimes.ort import KIND as ORT_KIND
from attn_export.runtimes.timing import LatencyStats, measure_alternating
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds

__all__ = ["DecodeCell", "PrefillCell", "decode_cell", "prefill_cell", "torch_runners"]


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


def _sdpa_twin(spec: ModelSpec, module: Any) -> Any | None:
    """The same weights in SDPAMultiHeadAttention, for seed-style multi-head modules."""
    from attn_export.zoo import MultiHeadAttention, SDPAMultiHeadAttention

    if not isinstance(module, MultiHeadAttention) or isinstance(module, SDPAMultiHeadAttention):
        return None
    twin = SDPAMultiHeadAttention(module.hidden_dim, module.num_heads, getattr(module, "causal", False))
    twin.load_state_dict(module.state_dict())
    return twin.eval()


def torch_runners(spec: ModelSpec, module: Any, provider: str, threads: int | None, twin: bool) -> dict[str, Runtime]:
    """The PyTorch side: the module as it is (``EAGER``) and, with ``twin``, its SDPA twin."""
    from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

    device = torch_device_for(provider)
    runners: dict[str, Runtime] = {
        EAGER: TorchRuntime(module, spec.inputs, spec.outputs, spec.dims, device=device, threads=threads)
    }
    other = _sdpa_twin(spec, module) if twin else None
    if other is not None:
        runners["torch-sdpa"] = TorchRuntime(other, spec.inputs, spec.outputs, device=device, threads=threads)
    return runners


def _verdict(row: LatencyStats, eager: LatencyStats) -> str:
    if clearly_faster(row, eager):
        return "faster"
    if clearly_faster(eager, row):
        return "slower"
    return "within noise"


def prefill_cell(cell: PrefillCell) -> list[BenchRow]:
    """Every runner at the cell's shape, timed in turns; rows in runner order."""
    from attn_export.exporter.factory import instantiate

    spec, options = cell.spec, cell.options
    module = instantiate(spec)
    unranged = dataclasses.replace(spec, dims={})  # bench may time shapes outside the ranges
    runners = torch_runners(unranged, module, options.provider, options.threads, twin=True)
    runners.update(graph_runners(cell.out_dir, cell.manifest, spec, options))
    feeds = make_feeds(spec, cell.sizes, 0)
    flops = count_flops(module, feeds)
    in_range = all(spec.dims[k].min <= v <= spec.dims[k].max for k, v in cell.sizes.items())
    with contextlib.ExitStack() as active:
        calls = {label: active.enter_context(runner).prepare(feeds) for label, runner in runners.items()}
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
            )
        )
    return rows


def decode_cell(cell: DecodeCell) -> list[DecodeRow]:
    """Every runner decoding the cell's window from the same prefilled cache, in turns."""
    from attn_export.exporter.factory import instantiate

    spec, options, plan = cell.spec, cell.options, cell.plan
    module = instantiate(spec)
    runners = torch_runners(spec, module, options.provider, options.threads, twin=False)
    runners.update(graph_runners(cell.out_dir, cell.manifest, spec, options))
    with contextlib.ExitStack() as active:
        decoders = {label: active.enter_context(runner).decoder(plan) for label, runner in runners.items()}
        stats = measure_alternating({label: d.step for label, d in decoders.items()}, budget_s=options.budget_s)
    graphs = {
        label: (name, cell.out_dir / entry.file)
        for label, (name, entry) in graph_entries(cell.manifest, spec, options).items()
    }
    weights = {label: graph_weight_bytes(path) for label, (_, path) in graphs.items()}
    weights[EAGER] = module_weight_bytes(module)
    outside = {
        label: outside_kernels(path, runners[label], plan, options.provider, options.threads or 1)
        for label, (name, path) in graphs.items()
        if name == ORT_RUNTIME
    }
    base = stats[EAGER]
    tokens = cell.batch * cell.seq
    rows = []
    shared = {label: getattr(d, "shared", None) for label, d in decoders.items()}
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
            )
        )
    return rows
