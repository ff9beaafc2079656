"""``bench --decode``: the cost of one decode step (one new token) against the cache's length.

For each model with a key/value cache (``spec.cache``), batch size and past length, PyTorch
eager (with its own cache) and ONNX Runtime (each built variant) run decode steps at
seq 1: per-token p50/p90, tokens/s, the ratio to eager, and peak memory per runner.

How a step is measured:

* The cache is **prefilled with seeded random values** of shape ``[batch, kv_heads, past,
  head_dim]``, not by a prompt step: a step's cost depends on the cache's shape, not its
  values, and a prompt of ``past`` tokens would need ``seq`` up to 2048, which decoder
  specs do not declare (the zoo's allow 64).
* Each side decodes a window of ``window`` steps from that cache, feeding each step's
  presents back as the next step's pasts, then starts again from the prefilled cache; a
  row at past P times steps at past P .. P + window - 1 (fewer where the spec's range ends).
* ONNX Runtime runs with inputs and outputs bound (IOBinding): the prefilled cache, the
  token and every step's mask and positions are OrtValues made once; the presents ONNX
  Runtime allocates are bound as the next step's pasts as they are. Nothing crosses numpy
  between steps. What still copies: the graph's ``Concat`` writes past + new into a fresh
  present every step (an O(cache) copy inherent to separate past/present tensors; PyTorch's
  ``torch.cat`` does the same), and on CPU the presents are newly allocated from ONNX
  Runtime's arena each step.
* PyTorch and ONNX Runtime take turns in blocks (``timing.measure_alternating``) with the
  same threads, and ONNX Runtime's idle threads do not spin, so neither steals the other's
  cores. A difference inside the noise decides nothing (``compare.latency.clearly_faster``).

Results are plain dataclasses; ``report/bench_text.py`` and ``report/plot.py`` render them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.artifacts.manifest import Manifest, load_manifest
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.artifacts.provenance import versions
from attn_export.compare.latency import clearly_faster, noise
from attn_export.errors import InputError, UsageError
from attn_export.exporter.graph_checks import check_model
from attn_export.pipelines.bench.memory import peak_rss_mb
from attn_export.pipelines.bench.run import machine_description
from attn_export.pipelines.build import BuildOptions, BuildSummary, build_models
from attn_export.runtimes.base import check_feeds
from attn_export.runtimes.timing import LatencyStats, measure_alternating, physical_cores
from attn_export.spec import ModelSpec, load_spec, variant_key
from attn_export.spec.cache import CacheSpec, cache_of
from attn_export.spec.inputs import make_tensor
from attn_export.spec.masks import CONVENTIONS

__all__ = [
    "DEFAULT_PASTS",
    "DecodeBenchOptions",
    "DecodeBenchReport",
    "DecodeRow",
    "DecodeWindow",
    "EagerDecoder",
    "OrtDecoder",
    "bench_decode_models",
    "past_lengths",
    "plan_window",
    "run_decode_bench",
]

#: Past lengths timed unless ``--past`` says otherwise, clamped to each spec's range.
DEFAULT_PASTS = (0, 128, 512, 2048)
#: Decode steps per window before the cache is reset to its prefilled length.
DEFAULT_WINDOW = 8
PREFILL = "seeded random cache values (a step's cost depends on the cache's shape, not its values)"

Feeds = dict[str, np.ndarray]


@dataclass
class DecodeBenchOptions:
    """What ``attn-export bench --decode`` was asked to measure."""

    batches: Sequence[int] = (1,)
    #: Past lengths; None means ``DEFAULT_PASTS`` clamped to each spec's past range.
    pasts: Sequence[int] | None = None
    variants: Sequence[str] = ("fp32", "ort-fused", "int8")
    provider: str = "cpu"
    #: Threads for every runner; None means the physical cores.
    threads: int | None = None
    budget_s: float = 0.2
    memory: bool = True
    window: int = DEFAULT_WINDOW
    seed: int = 0


@dataclass
class DecodeRow:
    """One model x runner x batch x past length: the cost of one decode step."""

    model: str
    runner: str  # torch-eager, or ort:<variant>
    batch: int
    past: int
    #: Steps per window: the timed steps saw past .. past + window - 1.
    window: int
    latency: LatencyStats
    tokens_per_s: float
    ratio_to_eager: float | None
    #: Against eager beyond the noise: "faster", "slower", "within noise"; None for eager.
    verdict: str | None

    @property
    def noise(self) -> str | None:
        """Why this row's timing is too noisy to compare, or None."""
        return noise(self.latency)


@dataclass
class DecodeBenchReport:
    """All figures of one ``bench --decode`` run, with what they were measured on."""

    machine: str
    versions: dict[str, str]
    threads: int
    provider: str
    seed: int
    prefill: str = PREFILL
    rows: list[DecodeRow] = field(default_factory=list)
    #: Peak resident memory (MiB) per model and runner: one step at the largest batch and
    #: past, in a fresh process (a plain run, no IOBinding).
    memory_mb: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeBenchReport:
        rows = [DecodeRow(**{**r, "latency": LatencyStats(**r["latency"])}) for r in d["rows"]]
        return cls(
            d["machine"], d["versions"], d["threads"], d["provider"], d["seed"], d["prefill"], rows, d["memory_mb"]
        )


def _cache(spec: ModelSpec) -> CacheSpec:
    cache = cache_of(spec)
    if cache is None:
        raise UsageError(
            f"{spec.name}: bench --decode needs a model with a key/value cache (inputs past_key_values.<i>.key/value, "
            "outputs present.<i>.key/value); it declares none"
        )
    return cache


def past_lengths(spec: ModelSpec, requested: Sequence[int] | None = None) -> list[int]:
    """The past lengths to time: ``requested`` (each within the spec's past range, else
    InputError), or ``DEFAULT_PASTS`` clamped to that range."""
    cache = _cache(spec)
    r = spec.dims[cache.past_dim]
    if requested is None:
        return sorted({min(max(p, r.min), r.max) for p in DEFAULT_PASTS})
    outside = [p for p in requested if not r.min <= p <= r.max]
    if outside:
        raise InputError(
            f"{spec.name}: past length {', '.join(map(str, outside))} is outside '{cache.past_dim}' "
            f"[{r.min}, {r.max}] (choose with --past)"
        )
    return list(dict.fromkeys(requested))


@dataclass
class DecodeWindow:
    """What one window of decode steps feeds: the prefilled pasts, and per step the other
    inputs (the same token every step; the mask and positions grow with the cache)."""

    cache: CacheSpec
    past: int
    pasts: Feeds
    steps: list[Feeds]

    def feeds(self, step: int, pasts: Mapping[str, np.ndarray]) -> Feeds:
        """Step ``step``'s full feeds with ``pasts``, for a plain ``run``."""
        return {**self.steps[step], **pasts}


def plan_window(spec: ModelSpec, batch: int, past: int, window: int, seed: int) -> DecodeWindow:
    """The feeds of ``window`` one-token steps from a cache of ``past`` random entries,
    shortened where the spec's past range ends; each step's feeds pass ``check_feeds``."""
    cache = _cache(spec)
    if "batch" not in spec.dims:
        raise InputError(f"{spec.name}: bench needs a dim named 'batch' (dims: {', '.join(spec.dims)})")
    seq = spec.dims[cache.seq_dim]
    if not seq.min <= 1 <= seq.max:
        raise InputError(f"{spec.name}: a decode step has {cache.seq_dim} 1, outside [{seq.min}, {seq.max}]")
    window = max(1, min(window, spec.dims[cache.past_dim].max - past + 1))
    rng = np.random.default_rng(seed)
    sizes = spec.with_sums({name: 1 for name in spec.dims} | {"batch": batch, cache.past_dim: past})
    past_names = {p for p, _ in cache.pairs}
    per_step = past_names | {cache.mask, cache.positions}
    pasts = {t.name: make_tensor(t, sizes, rng) for t in spec.inputs if t.name in past_names}
    fixed = {t.name: make_tensor(t, sizes, rng) for t in spec.inputs if t.name not in per_step}
    steps = []
    for k in range(window):
        feeds = dict(fixed)
        for t in spec.inputs:
            if t.name == cache.mask:
                assert t.convention is not None
                feeds[t.name] = CONVENTIONS[t.convention].encode(np.ones((batch, past + k + 1), dtype=bool), t.dtype)
            elif t.name == cache.positions:
                feeds[t.name] = np.full((batch, 1), past + k, dtype=t.dtype)
        steps.append(feeds)
    window_plan = DecodeWindow(cache, past, pasts, steps)
    inputs = {t.name: t for t in spec.inputs}
    for k in (0, window - 1):  # the first and the longest step: every size is in range
        shapes = {p: (*pasts[p].shape[:2], past + k, pasts[p].shape[3]) for p in past_names}
        stand_in = {p: np.zeros(s, dtype=inputs[p].dtype) for p, s in shapes.items()}
        check_feeds(window_plan.feeds(k, stand_in), spec.inputs, spec.dims)
    return window_plan


class EagerDecoder:
    """The PyTorch module decoding a window: each step's presents (torch tensors) are the
    next step's pasts; after the window it starts again from the prefilled cache."""

    def __init__(self, module: Any, spec: ModelSpec, plan: DecodeWindow, device: str = "cpu") -> None:
        torch = require("torch", "running the PyTorch original")

        self.module = module
        self.plan = plan
        self._names = [t.name for t in spec.inputs]
        self._outputs = [t.name for t in spec.outputs]
        self._steps = [
            {n: torch.from_numpy(np.ascontiguousarray(v)).to(device) for n, v in feeds.items()} for feeds in plan.steps
        ]
        self._prefilled = {n: torch.from_numpy(v).to(device) for n, v in plan.pasts.items()}
        self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self._no_grad = torch.no_grad
        self.restart()

    def restart(self) -> None:
        self._k = 0
        self._pasts: dict[str, Any] = dict(self._prefilled)
        self._last: dict[str, Any] = {}

    def step(self) -> None:
        """One decode step; the window restarts when it is used up."""
        if self._k == len(self._steps):
            self.restart()
        feeds = {**self._steps[self._k], **self._pasts}
        with self._no_grad():
            result = self.module(*(feeds[n] for n in self._names))
        values = result if isinstance(result, tuple | list) else (result,)
        self._last = dict(zip(self._outputs, values, strict=True))
        self._pasts = {past: self._last[present] for past, present in self.plan.cache.pairs}
        self._k += 1
        self._sync()

    def outputs(self) -> Feeds:
        """The last step's outputs as numpy copies (for checks, never timed)."""
        return {n: v.detach().cpu().numpy().copy() for n, v in self._last.items()}


class OrtDecoder:
    """An ONNX Runtime session decoding a window with inputs and outputs bound: the presents
    ONNX Runtime allocates are bound as the next step's pasts, with no numpy round trip."""

    def __init__(self, session: Any, spec: ModelSpec, plan: DecodeWindow, provider: str = "cpu") -> None:
        import onnxruntime as ort

        self.session = session
        self.plan = plan
        self._device = "cuda" if provider == "cuda" else "cpu"

        self._arrays: list[np.ndarray] = []  # on CPU an OrtValue shares its array's memory: keep them alive

        def value(arr: np.ndarray) -> Any:
            self._arrays.append(np.ascontiguousarray(arr))
            return ort.OrtValue.ortvalue_from_numpy(self._arrays[-1], self._device, 0)

        cache = plan.cache
        per_step = {cache.mask, cache.positions} - {None}
        self._prefilled = {n: value(v) for n, v in plan.pasts.items()}
        self._per_step = [{n: value(v) for n, v in feeds.items() if n in per_step} for feeds in plan.steps]
        self._binding = session.io_binding()
        self._fixed = {n: value(v) for n, v in plan.steps[0].items() if n not in per_step}
        for name, v in self._fixed.items():  # bound once: the same token every step
            self._binding.bind_ortvalue_input(name, v)
        # get_outputs() answers in the order outputs were first bound: bind them all now, in
        # the spec's order. Outputs other than the presents keep their shape, so ONNX Runtime
        # reuses their buffer every step; a present grows, so it is bound afresh each step.
        self._outputs = [t.name for t in spec.outputs]
        presents = {present for _, present in cache.pairs}
        self._presents = [name for name in self._outputs if name in presents]
        for name in self._outputs:
            self._binding.bind_output(name, self._device)
        self._sync = self._binding.synchronize_outputs if self._device != "cpu" else (lambda: None)
        self.restart()

    def restart(self) -> None:
        self._k = 0
        self._pasts: dict[str, Any] = dict(self._prefilled)
        self._last: list[Any] = []

    def step(self) -> None:
        """One decode step; the window restarts when it is used up."""
        if self._k == len(self._per_step):
            self.restart()
        binding = self._binding
        for name, v in {**self._per_step[self._k], **self._pasts}.items():
            binding.bind_ortvalue_input(name, v)
        for name in self._presents:  # rebinding keeps its place, and ONNX Runtime allocates it anew
            binding.bind_output(name, self._device)
        self.session.run_with_iobinding(binding)
        self._last = binding.get_outputs()
        by_name = dict(zip(self._outputs, self._last, strict=True))
        self._pasts = {past: by_name[present] for past, present in self.plan.cache.pairs}
        self._k += 1
        self._sync()

    def outputs(self) -> Feeds:
        """The last step's outputs as numpy copies (for checks, never timed)."""
        return {n: v.numpy().copy() for n, v in zip(self._outputs, self._last, strict=True)}


def _verdict(row: LatencyStats, eager: LatencyStats) -> str:
    if clearly_faster(row, eager):
        return "faster"
    if clearly_faster(eager, row):
        return "slower"
    return "within noise"


def run_decode_bench(
    out_dir: Path,
    manifest: Manifest,
    specs: Sequence[ModelSpec],
    options: DecodeBenchOptions,
    on_row: Callable[[DecodeRow], None] | None = None,
) -> DecodeBenchReport:
    """Time a decode step of every requested runner at every batch and past length;
    graphs come from ``out_dir``."""
    from attn_export.exporter.factory import instantiate
    from attn_export.runtimes.ort import OnnxRuntime
    from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

    threads = options.threads or physical_cores()
    options = dataclasses.replace(options, threads=threads)
    report = DecodeBenchReport(
        machine=machine_description(),
        versions=versions(),
        threads=threads,
        provider=options.provider,
        seed=options.seed,
    )
    device = torch_device_for(options.provider)
    for spec in specs:
        pasts = past_lengths(spec, options.pasts)
        eager = TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims, device=device, threads=threads)
        sessions: dict[str, OnnxRuntime] = {}
        for variant in options.variants:
            entry = manifest.models[variant_key(spec.name, variant)]
            path = out_dir / entry.file
            check_model(load_model_file(path), entry.name, path)  # never time a graph verify would refuse
            sessions[f"ort:{variant}"] = OnnxRuntime(  # no spinning threads to slow the PyTorch steps
                path, spec.inputs, spec.outputs, spec.dims, provider=options.provider, threads=threads, spinning=False
            )
        with eager:
            for ort_runtime in sessions.values():
                ort_runtime.activate()
            try:
                for batch in options.batches:
                    for past in pasts:
                        plan = plan_window(spec, batch, past, options.window, options.seed)
                        decoders: dict[str, EagerDecoder | OrtDecoder] = {
                            "torch-eager": EagerDecoder(eager.module, spec, plan, device)
                        }
                        for label, rt in sessions.items():
                            decoders[label] = OrtDecoder(rt.session, spec, plan, options.provider)
                        stats = measure_alternating(
                            {label: d.step for label, d in decoders.items()}, budget_s=options.budget_s
                        )
                        base = stats["torch-eager"]
                        for label, s in stats.items():
                            row = DecodeRow(
                                model=spec.name,
                                runner=label,
                                batch=batch,
                                past=past,
                                window=len(plan.steps),
                                latency=s,
                                tokens_per_s=batch * 1000 / s.p50_ms,
                                ratio_to_eager=s.p50_ms / base.p50_ms if base.p50_ms > 0 else None,
                                verdict=None if label == "torch-eager" else _verdict(s, base),
                            )
                            report.rows.append(row)
                            if on_row:
                                on_row(row)
            finally:
                for ort_runtime in sessions.values():
                    ort_runtime.deactivate()
        if options.memory:
            report.memory_mb[spec.name] = _memory(spec, out_dir, manifest, options, max(options.batches), max(pasts))
    return report


def _memory(
    spec: ModelSpec, out_dir: Path, manifest: Manifest, options: DecodeBenchOptions, batch: int, past: int
) -> dict[str, float | None]:
    """Each runner's peak RSS for one step at (batch, past), each in a fresh process."""
    cache = _cache(spec)
    base = {
        "spec": spec.to_dict(),
        "folder": spec.search_path,
        "sizes": spec.with_sums({name: 1 for name in spec.dims} | {"batch": batch, cache.past_dim: past}),
        "provider": options.provider,
        "threads": options.threads,
    }
    out: dict[str, float | None] = {"torch-eager": peak_rss_mb({**base, "runner": "torch"})}
    for variant in options.variants:
        entry = manifest.models[variant_key(spec.name, variant)]
        out[f"ort:{variant}"] = peak_rss_mb({**base, "runner": "onnxruntime", "file": str(out_dir / entry.file)})
    return out


def bench_decode_models(
    spec_paths: Sequence[Path],
    out_dir: Path,
    options: DecodeBenchOptions,
    on_row: Callable[[DecodeRow], None] | None = None,
    *,
    skip_without_cache: bool = False,
) -> tuple[BuildSummary, DecodeBenchReport | None]:
    """Build the variants still missing from ``out_dir``, then time decode steps; no report
    when a graph failed to build. A model without a cache is a UsageError, or left out
    with ``skip_without_cache`` (the whole zoo); the past lengths are checked before
    anything is built."""
    specs = [load_spec(p) for p in spec_paths]
    if skip_without_cache:
        kept = [(p, s) for p, s in zip(spec_paths, specs, strict=True) if cache_of(s) is not None]
        if not kept:
            raise UsageError("bench --decode: none of these models has a key/value cache")
        spec_paths, specs = [p for p, _ in kept], [s for _, s in kept]
    for spec in specs:
        past_lengths(spec, options.pasts)
    built = build_models(
        spec_paths, BuildOptions(out_dir, variants=tuple(dict.fromkeys(options.variants)), provider=options.provider)
    )
    if any(not r.ok for r in built.results):
        return built, None
    return built, run_decode_bench(out_dir, load_manifest(out_dir), specs, options, on_row)
