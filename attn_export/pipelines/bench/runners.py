"""What every bench times and how: the PyTorch runners (eager, its SDPA twin, compiled), the
graph runners, built from the runtime registry for each requested runtime and variant, each
runner's peak memory in a fresh process, and the machine the figures were measured on."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path
from typing import Any

from attn_export.artifacts.manifest import Manifest, ManifestEntry
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.errors import RuntimeFailure, UsageError
from attn_export.exporter.graph_checks import check_model
from attn_export.model_spec import ModelSpec, variant_key
from attn_export.model_spec.cache import cache_of
from attn_export.model_spec.memory import memory_budget
from attn_export.pipelines.bench.memory import peak_rss_mb
from attn_export.pipelines.bench.results import RunnerOptions
from attn_export.runtimes import RUNTIMES, Runtime
from attn_export.runtimes.allocator import keep_freed_memory
from attn_export.runtimes.timing import physical_cores

__all__ = [
    "COMPILED",
    "EAGER",
    "SDPA",
    "graph_entries",
    "graph_runners",
    "graph_notes",
    "peak_memory",
    "timing_machine",
    "torch_runners",
]

#: The PyTorch module as it is: every other runner's ratio is taken against it.
EAGER = "torch-eager"
#: The same weights in the zoo's SDPA module, where the module is the seed's.
SDPA = "torch-sdpa"
#: The module through ``torch.compile(dynamic=True)`` (``RunnerOptions.torch_compile``).
COMPILED = "torch-compile"


def timing_machine() -> str:
    """CPU model, usable cores and the C allocator, for titles and reports; called where a
    run that times starts, it also sets the allocator every timing here then runs with
    (``runtimes.allocator``: each process that times sets it alike)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {physical_cores()} cores, allocator: {keep_freed_memory()}"


def _sdpa_twin(module: Any) -> Any | None:
    """The same weights in SDPAMultiHeadAttention, for seed-style multi-head modules."""
    from attn_export.zoo import MultiHeadAttention, SDPAMultiHeadAttention

    if not isinstance(module, MultiHeadAttention) or isinstance(module, SDPAMultiHeadAttention):
        return None
    twin = SDPAMultiHeadAttention(module.hidden_dim, module.num_heads, getattr(module, "causal", False))
    twin.load_state_dict(module.state_dict())
    return twin.eval()


def torch_runners(spec: ModelSpec, module: Any, options: RunnerOptions) -> tuple[dict[str, Runtime], dict[str, str]]:
    """The PyTorch runners of ``module`` by label, with the bench's threads on the provider's
    device: eager, its SDPA twin (not for a decoder step: the twin has no cache) and, with
    ``options.torch_compile``, the module compiled; and the runners that cannot run here,
    with why (Inductor without a C++ compiler)."""
    from attn_export.runtimes.torch_compiled import CompiledTorchRuntime, inductor_unavailable
    from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

    device = torch_device_for(options.provider)
    runners: dict[str, Runtime] = {
        EAGER: TorchRuntime(module, spec.inputs, spec.outputs, device=device, threads=options.threads)
    }
    twin = _sdpa_twin(module) if cache_of(spec) is None else None
    if twin is not None:
        runners[SDPA] = TorchRuntime(twin, spec.inputs, spec.outputs, device=device, threads=options.threads)
    unavailable = {}
    if options.torch_compile:
        reason = inductor_unavailable(device)
        if reason is not None:
            unavailable[COMPILED] = reason
        else:
            runners[COMPILED] = CompiledTorchRuntime(
                module, spec.inputs, spec.outputs, device=device, threads=options.threads
            )
    return runners, unavailable


def graph_entries(manifest: Manifest, spec: ModelSpec, options: RunnerOptions) -> dict[str, tuple[str, ManifestEntry]]:
    """Runner label -> (runtime name, graph) for every requested runtime and variant, but
    the runners ``options.skipped``."""
    out = {}
    for name in options.runtimes:
        kind = RUNTIMES[name]
        if kind.providers and options.provider not in kind.providers:
            raise UsageError(f"runtime {name} does not run on provider {options.provider}")
        for variant in options.variants:
            label = kind.runner_label(variant)
            if label not in options.skipped:
                out[label] = (name, manifest.models[variant_key(spec.name, variant)])
    return out


def graph_notes(manifest: Manifest, spec: ModelSpec, options: RunnerOptions) -> dict[str, str]:
    """``model runner`` -> what the row times where its label does not say: the plain graph,
    where its variant left it as it was (int8 of a module without a MatMul weight); the
    variant ``auto`` chose, and why."""
    out = {}
    for label, (_, entry) in graph_entries(manifest, spec, options).items():
        info = entry.variant_info
        if isinstance(info.get("unchanged"), str):
            out[f"{spec.name} {label}"] = f"times the plain graph: {info['unchanged']}"
        elif isinstance(info.get("chosen"), str):
            out[f"{spec.name} {label}"] = f"times {info['chosen']}, auto's choice: {info.get('why', '')}"
    return out


def graph_runners(out_dir: Path, manifest: Manifest, spec: ModelSpec, options: RunnerOptions) -> dict[str, Runtime]:
    """One runtime per runner label, made by its registry row, with the bench's threads;
    a graph verify would refuse is never timed. Bench may time shapes outside the declared
    ranges (its rows say so), so the runtimes are not held to them."""
    runners = {}
    for label, (name, entry) in graph_entries(manifest, spec, options).items():
        path = out_dir / entry.file
        check_model(load_model_file(path), entry.name, path)
        runners[label] = _runtime(path, name, spec, options)
    return runners


def _runtime(path: Path, name: str, spec: ModelSpec, options: RunnerOptions) -> Runtime:
    kind = RUNTIMES[name]
    (target,) = kind.targets([options.provider])
    unranged = dataclasses.replace(spec, dims={})
    budget = memory_budget(options.max_memory, spec)
    return kind.make(path, unranged, target, options.threads, budget, options.region_timeout_s)


def unloadable(out_dir: Path, manifest: Manifest, spec: ModelSpec, options: RunnerOptions) -> dict[str, str]:
    """Runner label -> why, for each optional variant's graph (``RunnerOptions.optional``) a
    runtime asked for cannot load: the reference evaluator has no com.microsoft ops."""
    out = {}
    for label, (name, entry) in graph_entries(manifest, spec, options).items():
        if entry.variant in options.optional:
            try:
                with _runtime(out_dir / entry.file, name, spec, options):
                    pass
            except RuntimeFailure as e:  # cannot load; a missing provider is the run's to refuse
                out[label] = str(e)
    return out


def peak_memory(
    out_dir: Path, manifest: Manifest, spec: ModelSpec, options: RunnerOptions, sizes: dict[str, int]
) -> dict[str, float | None]:
    """Each runner's peak RSS (MiB) for one run at ``sizes``, each in a fresh process."""
    base: dict[str, Any] = {
        "spec": spec.to_dict(),
        "folder": spec.search_path,
        "sizes": sizes,
        "provider": options.provider,
        "threads": options.threads,
        "budget": memory_budget(options.max_memory, spec),
        "timeout": options.region_timeout_s,
    }
    out: dict[str, float | None] = {EAGER: peak_rss_mb({**base, "runner": "torch"})}
    for label, (name, entry) in graph_entries(manifest, spec, options).items():
        out[label] = peak_rss_mb({**base, "runner": name, "file": str(out_dir / entry.file)})
    return out
