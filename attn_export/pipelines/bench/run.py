"""The bench pipeline: for each model, shape and runner (PyTorch eager, PyTorch SDPA,
ONNX Runtime per variant), latency percentiles, throughput, the ratio to eager, achieved
GFLOP/s and its share of this machine's measured matmul peak, and peak memory per runner.

Results are plain dataclasses; ``report/bench_text.py`` and ``report/plot.py`` render them.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_export.artifacts.manifest import Manifest, load_manifest
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.artifacts.provenance import versions
from attn_export.compare.latency import noise
from attn_export.errors import InputError
from attn_export.exporter.graph_checks import check_model
from attn_export.pipelines.bench.flops import count_flops, matmul_peak_gflops
from attn_export.pipelines.bench.memory import peak_rss_mb
from attn_export.pipelines.build import BuildOptions, BuildSummary, build_models
from attn_export.runtimes.timing import LatencyStats, measure, physical_cores
from attn_export.spec import ModelSpec, load_spec, variant_key
from attn_export.spec.inputs import make_feeds

__all__ = ["BenchOptions", "BenchReport", "BenchRow", "bench_models", "machine_description", "run_bench"]


@dataclass
class BenchOptions:
    """What ``attn-export bench`` was asked to measure."""

    batches: Sequence[int]
    seqs: Sequence[int]
    variants: Sequence[str] = ("fp32", "ort-fused", "int8")
    provider: str = "cpu"
    #: Threads for every runner; None means the physical cores.
    threads: int | None = None
    budget_s: float = 0.2
    memory: bool = True


@dataclass
class BenchRow:
    """One model x runner x shape."""

    model: str
    runner: str  # torch-eager, torch-sdpa, or ort:<variant>
    batch: int
    seq: int
    latency: LatencyStats
    flops: int
    tokens_per_s: float
    ratio_to_eager: float | None
    gflops: float
    peak_share: float
    in_verified_range: bool

    @property
    def noise(self) -> str | None:
        """Why this row's timing is too noisy to compare, or None."""
        return noise(self.latency)


@dataclass
class BenchReport:
    """All figures of one bench run, with what they were measured on."""

    machine: str
    versions: dict[str, str]
    threads: int
    provider: str
    peak_gflops: dict[str, float]
    rows: list[BenchRow] = field(default_factory=list)
    #: Peak resident memory (MiB) per model and runner, at the run's largest shape.
    memory_mb: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchReport:
        rows = [BenchRow(**{**r, "latency": LatencyStats(**r["latency"])}) for r in d["rows"]]
        return cls(d["machine"], d["versions"], d["threads"], d["provider"], d["peak_gflops"], rows, d["memory_mb"])


def machine_description() -> str:
    """CPU model and usable cores, for titles and reports."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {physical_cores()} cores"


def _sizes(spec: ModelSpec, batch: int, seq: int) -> dict[str, int]:
    if "batch" not in spec.dims:
        raise InputError(f"{spec.name}: bench needs a dim named 'batch' (dims: {', '.join(spec.dims)})")
    return {name: batch if name == "batch" else seq for name in spec.dims}


def _sdpa_twin(spec: ModelSpec, module: Any) -> Any | None:
    """The same weights in SDPAMultiHeadAttention, for seed-style multi-head modules."""
    from attn_export.zoo import MultiHeadAttention, SDPAMultiHeadAttention

    if not isinstance(module, MultiHeadAttention) or isinstance(module, SDPAMultiHeadAttention):
        return None
    twin = SDPAMultiHeadAttention(module.hidden_dim, module.num_heads, getattr(module, "causal", False))
    twin.load_state_dict(module.state_dict())
    return twin.eval()


def run_bench(
    out_dir: Path,
    manifest: Manifest,
    specs: Sequence[ModelSpec],
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
) -> BenchReport:
    """Measure every requested runner at every shape; graphs come from ``out_dir``."""
    from attn_export.exporter.factory import instantiate
    from attn_export.runtimes.ort import OnnxRuntime
    from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

    threads = options.threads or physical_cores()
    options = dataclasses.replace(options, threads=threads)
    report = BenchReport(
        machine=machine_description(),
        versions=versions(),
        threads=threads,
        provider=options.provider,
        peak_gflops=matmul_peak_gflops(threads),
    )
    device = torch_device_for(options.provider)
    for spec in specs:
        module = instantiate(spec)
        runners: dict[str, Any] = {
            "torch-eager": TorchRuntime(module, spec.inputs, spec.outputs, device=device, threads=options.threads)
        }
        twin = _sdpa_twin(spec, module)
        if twin is not None:
            runners["torch-sdpa"] = TorchRuntime(
                twin, spec.inputs, spec.outputs, device=device, threads=options.threads
            )
        for variant in options.variants:
            entry = manifest.models[variant_key(spec.name, variant)]
            path = out_dir / entry.file
            check_model(load_model_file(path), entry.name, path)  # never time a graph verify would refuse
            runners[f"ort:{variant}"] = OnnxRuntime(  # no spinning threads to slow the PyTorch runners
                path, spec.inputs, spec.outputs, provider=options.provider, threads=options.threads, spinning=False
            )
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
                    if label == "torch-eager":
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
                    )
                    report.rows.append(row)
                    if on_row:
                        on_row(row)
        if options.memory:
            largest = _sizes(spec, max(options.batches), max(options.seqs))
            base = {
                "spec": spec.to_dict(),
                "folder": spec.search_path,
                "sizes": largest,
                "provider": options.provider,
                "threads": options.threads,
            }
            report.memory_mb[spec.name] = {"torch-eager": peak_rss_mb({**base, "runner": "torch"})}
            for variant in options.variants:
                entry = manifest.models[variant_key(spec.name, variant)]
                report.memory_mb[spec.name][f"ort:{variant}"] = peak_rss_mb(
                    {**base, "runner": "onnxruntime", "file": str(out_dir / entry.file)}
                )
    return report


def bench_models(
    spec_paths: Sequence[Path],
    out_dir: Path,
    options: BenchOptions,
    on_row: Callable[[BenchRow], None] | None = None,
) -> tuple[BuildSummary, BenchReport | None]:
    """Build the variants still missing from ``out_dir``, then measure them; no report
    when a graph failed to build."""
    built = build_models(
        spec_paths, BuildOptions(out_dir, variants=tuple(dict.fromkeys(options.variants)), provider=options.provider)
    )
    if any(not r.ok for r in built.results):
        return built, None
    specs = [load_spec(p) for p in spec_paths]
    return built, run_bench(out_dir, load_manifest(out_dir), specs, options, on_row)
