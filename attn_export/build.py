"""The build pipeline: spec -> module -> ONNX -> variants -> checks -> smoke run ->
artifacts + manifest.

Each (model, variant) fills a ``BuildResult``; one failing does not stop the others unless
``fail_fast``. Artifacts are written only after every check passed, and committed graph by
graph through the manifest (``artifacts.folder``), so an interrupted build leaves every
graph's previous or new build, never a mix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import onnx

from attn_export import __version__
from attn_export._deps import require
from attn_export.artifacts.files import LOCK_WAIT_S, atomic_write, build_lock, sha256_bytes, sha256_file
from attn_export.artifacts.folder import commit, recover, remove_leftovers, stage
from attn_export.artifacts.golden import GoldenCase, encode_golden
from attn_export.artifacts.manifest import Manifest, ManifestEntry, load_manifest
from attn_export.compare import compare_outputs
from attn_export.compare.policy import clearly_faster, noise
from attn_export.decode import DEFAULT_STEPS, pytorch_trajectories, record_trajectory
from attn_export.errors import (
    ArtifactError,
    AttnExportError,
    ExportFailure,
    GraphCheckError,
    RuntimeFailure,
    UsageError,
)
from attn_export.export.factory import instantiate
from attn_export.export.graph_checks import check_deterministic, check_dynamic_axes, check_model
from attn_export.export.source import module_sources
from attn_export.export.torch_export import export_onnx, stamp_metadata
from attn_export.export.variants import make_variant
from attn_export.fully_masked import settle
from attn_export.mask_probe import check_masks
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.spec import VARIANTS, ModelSpec, load_spec, variant_key
from attn_export.spec.cache import cache_of
from attn_export.spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.spec.distributions import DISTRIBUTIONS, case_label, split_label
from attn_export.spec.inputs import make_feeds
from attn_export.spec.masks import CASES
from attn_export.spec.shapes import ShapePoint, example_sizes, format_sizes, golden_points
from attn_export.spec.variants import auto_candidates
from attn_export.timing import LatencyStats, measure, physical_cores

__all__ = [
    "BuildOptions",
    "BuildResult",
    "BuildStatus",
    "BuildSummary",
    "build_models",
    "export_module",
    "versions",
]

#: Feeds for export examples and golden vectors use this seed (recorded in the golden file).
BUILD_SEED = 0
STAGES = ("spec", "module", "masks", "export", "variant", "checker", "axes", "smoke", "fully_masked", "write")
BuildStatus = Literal["built", "skipped", "failed"]
STATUSES: tuple[BuildStatus, ...] = ("built", "skipped", "failed")


@dataclass
class BuildOptions:
    """What ``attn-export build`` was asked to do."""

    out_dir: Path
    opset: int | None = None
    exporter: str | None = None
    force: bool = False
    fail_fast: bool = False
    #: Graph variants to build (keys of ``spec.VARIANTS``).
    variants: tuple[str, ...] = ("fp32",)
    #: Provider that ``ort-optimized`` optimizes for and ``auto`` times on.
    provider: str = "cpu"
    #: Seconds to wait for another build to release the output folder.
    lock_wait_s: float = LOCK_WAIT_S


@dataclass
class BuildResult:
    """One graph's build: each stage True (passed), False (failed) or None (did not run)."""

    name: str
    variant: str = "fp32"
    status: BuildStatus = "failed"
    seconds: float = 0.0
    file: str | None = None
    sha256: str | None = None
    error: str | None = None
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(STAGES))

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    @property
    def failed_stage(self) -> str | None:
        return next((k for k, v in self.stages.items() if v is False), None)


@dataclass
class BuildSummary:
    """All results of one build run."""

    out_dir: str
    results: list[BuildResult]
    seconds: float

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.results), default=0)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": self.out_dir,
            "seconds": round(self.seconds, 3),
            "counts": self.counts,
            "exit_code": self.exit_code,
            "results": [dataclasses.asdict(r) for r in self.results],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildSummary:
        return cls(d["out_dir"], [BuildResult(**r) for r in d["results"]], d["seconds"])


def versions() -> dict[str, str]:
    """Versions that shape an exported graph; recorded in metadata and the manifest."""
    import onnxruntime

    torch = require("torch", "building")
    onnxscript = require("onnxscript", "building")
    return {
        "attn_export": __version__,
        "torch": str(torch.__version__),
        "onnx": onnx.__version__,
        "onnxscript": str(getattr(onnxscript, "__version__", "unknown")),
        "onnxruntime": onnxruntime.__version__,
    }


@contextlib.contextmanager
def _stage(result: BuildResult, name: str) -> Iterator[None]:
    """Mark a stage failed while it runs and passed once it returns."""
    result.stages[name] = False
    yield
    result.stages[name] = True


V = TypeVar("V")


class _Once(Generic[V]):
    """A lazily computed value whose failure is remembered, so shared stages run once."""

    def __init__(self, compute: Callable[[], V]) -> None:
        self._compute = compute
        self._done = False
        self._value: V | None = None
        self._error: AttnExportError | None = None

    def get(self) -> V:
        if not self._done:
            self._done = True
            try:
                self._value = self._compute()
            except AttnExportError as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


@dataclass
class _Graph:
    """A variant's serialized graph with metadata, checked but not yet smoke-tested."""

    model: bytes
    info: dict[str, Any]
    warnings: list[str]


class _SpecBuild:
    """What every variant of one spec shares: the module, its exports, PyTorch's outputs."""

    def __init__(self, spec: ModelSpec, vers: dict[str, str], options: BuildOptions) -> None:
        self.spec = spec
        self.vers = vers
        self.options = options
        self.sizes = example_sizes(spec)
        self.sources = module_sources(spec)
        self.module = _Once(lambda: instantiate(spec))
        self.masks = _Once(self._check_masks)
        self.exports: dict[int, _Once[onnx.ModelProto]] = {}
        self.example = _Once(self._example)
        self.golden = _Once(self._golden_cases)
        #: The golden file's bytes, shared by every variant.
        self.golden_file = _Once(lambda: encode_golden(self.golden.get()))
        self.graphs: dict[str, _Once[_Graph]] = {}

    def _check_masks(self) -> None:
        """The module reads every mask as the spec says (``mask_probe``)."""
        with TorchRuntime(self.module.get(), self.spec.inputs, self.spec.outputs, self.spec.dims) as eager:
            check_masks(self.spec, eager, self.sizes, BUILD_SEED)

    def export(self, opset: int) -> onnx.ModelProto:
        """The module exported at ``opset``, checked; exported once per opset."""
        if opset not in self.exports:
            self.exports[opset] = _Once(lambda: self._export(opset))
        return self.exports[opset].get()

    def _export(self, opset: int) -> onnx.ModelProto:
        example = make_feeds(self.spec, self.sizes, BUILD_SEED)
        try:
            proto = export_onnx(self.module.get(), self.spec, example, opset=opset)
        except SystemExit as e:  # forward() exited: a failed export, not a successful build
            raise ExportFailure(f"{self.spec.name}: export failed: forward raised SystemExit: {e}") from e
        check_model(proto, self.spec.name)
        check_dynamic_axes(proto, self.spec.name, self.spec.inputs, self.spec.outputs, self.spec.dims)
        return proto

    def _cases(self, points: list[tuple[ShapePoint, str]], first_seed: int) -> list[GoldenCase]:
        spec = self.spec
        cases = []
        with TorchRuntime(self.module.get(), spec.inputs, spec.outputs, spec.dims) as eager:
            for i, (point, distribution) in enumerate(points):
                feeds = make_feeds(spec, point.sizes, first_seed + i, case=point.case, distribution=distribution)
                label = case_label(point.label, distribution)
                outputs = eager.run(feeds)
                floors = eager.precision_floor(feeds, outputs)
                cases.append(GoldenCase(label, dict(point.sizes), feeds, outputs, floors))
        return cases

    def _example(self) -> GoldenCase:
        return self._cases([(ShapePoint("example", self.sizes), DEFAULT_DISTRIBUTION)], BUILD_SEED)[0]

    def _golden_cases(self) -> list[GoldenCase]:
        """PyTorch's outputs at the golden shapes with unit-normal values (smoke-checked and
        recorded), at the distinct shape with each other distribution (recorded only: those
        are verify's to judge), and at the named mask cases (they settle fully masked rows)."""
        points = golden_points(self.spec)
        distinct = [p for p in points if p.label == "distinct"]
        plan = [(p, DEFAULT_DISTRIBUTION) for p in points]
        plan += [(p, d) for d in DISTRIBUTIONS if d != DEFAULT_DISTRIBUTION for p in distinct]
        return self._cases(plan, BUILD_SEED + 1) + self._trajectories()

    def _trajectories(self) -> list[GoldenCase]:
        """For a model with a cache: PyTorch's decode trajectories, recorded step by step."""
        if cache_of(self.spec) is None:
            return []
        with TorchRuntime(self.module.get(), self.spec.inputs, self.spec.outputs, self.spec.dims) as eager:
            recorded = pytorch_trajectories(eager, self.spec, DEFAULT_STEPS, BUILD_SEED)
        return [case for traj, outputs in recorded for case in record_trajectory(self.spec, traj, outputs)]

    def graph(self, name: str) -> _Graph:
        if name not in self.graphs:
            self.graphs[name] = _Once(lambda: self._make_graph(name))
        return self.graphs[name].get()

    def _make_graph(self, name: str) -> _Graph:
        spec, info = self.spec, VARIANTS[name]
        key = variant_key(spec.name, name)
        opset = max(spec.opset, info.export_opset or 0)
        try:
            graph = make_variant(name, self.export(opset), self.options.provider)
        except (ExportFailure, GraphCheckError) as e:
            raise type(e)(f"{key}: {e}") from e
        proto = stamp_metadata(
            graph.proto,
            {
                "attn_export.model": spec.name,
                "attn_export.variant": name,
                "attn_export.source_module": spec.module,
                "attn_export.spec_hash": spec.content_hash(),
                "attn_export.exporter": spec.exporter,
                "attn_export.opset": str(opset),
                **{f"attn_export.version.{k}": v for k, v in self.vers.items()},
            },
        )
        check_model(proto, key)
        check_deterministic(proto, key)
        check_dynamic_axes(proto, key, spec.inputs, spec.outputs, spec.dims)
        return _Graph(proto.SerializeToString(deterministic=True), graph.info, graph.warnings)

    def smoke(self, variant: str, model: bytes) -> None:
        """ONNX Runtime (CPU) against PyTorch at the example and golden shapes, at the
        variant's tolerance."""
        spec = self.spec
        tolerances = spec.tolerances(variant)
        cases = [c for c in self.golden.get() if c.label not in CASES]  # mask cases are settled, not smoked
        with OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, provider="cpu") as session:
            for case in [self.example.get(), *cases]:
                if split_label(case.label)[1] != DEFAULT_DISTRIBUTION:
                    continue
                where = f"{variant_key(spec.name, variant)}: smoke check at {case.label} ({format_sizes(case.sizes)})"
                try:
                    got = session.run(case.inputs)
                except RuntimeFailure as e:
                    raise GraphCheckError(f"{where} failed: {e}") from e
                failed = [c.reason() for c in compare_outputs(case.outputs, got, tolerances, case.floors)]
                failed = [r for r in failed if r]
                if failed:
                    raise GraphCheckError(f"{where} failed: {failed[0]}")


def _build_key(spec: ModelSpec, sources: dict[str, str], vers: dict[str, str], variant: str, provider: str) -> str:
    """What a graph depends on: the spec and weights, the module's source files, the tool
    versions, the variant and, where the variant depends on it, the provider."""
    target = provider if VARIANTS[variant].provider_dependent else None
    blob = json.dumps(
        {
            "spec": spec.content_hash(),
            "sources": sources,
            "versions": vers,
            "variant": variant,
            "provider": target,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _up_to_date(entry: ManifestEntry | None, key: str, out_dir: Path) -> bool:
    if entry is None or entry.build_key != key:
        return False
    try:
        return (
            sha256_file(out_dir / entry.file, out_dir) == entry.sha256
            and sha256_file(out_dir / entry.golden, out_dir) == entry.golden_sha256
        )
    except ArtifactError:
        return False


def _auto_choice(ctx: _SpecBuild) -> tuple[str, dict[str, Any]]:
    """Time each candidate at the spec's typical shape; the fastest within the model's own
    tolerance wins, but only if it beats the plain graph by more than the noise (and the
    timings are not noisy): otherwise the plain graph stays. Candidates that fail to
    build or to agree are recorded, not chosen."""
    spec, provider = ctx.spec, ctx.options.provider
    feeds = make_feeds(spec, spec.typical, BUILD_SEED)
    with TorchRuntime(ctx.module.get(), spec.inputs, spec.outputs, spec.dims) as eager:
        expected = eager.run(feeds)
    tolerances = spec.tolerances("auto")
    figures: dict[str, dict[str, Any]] = {}
    timings: dict[str, LatencyStats] = {}
    for name in auto_candidates(provider):
        try:
            model = ctx.graph(name).model
            with OnnxRuntime(
                model, spec.inputs, spec.outputs, spec.dims, provider=provider, threads=physical_cores()
            ) as session:
                comparisons = compare_outputs(expected, session.run(feeds), tolerances)
                stats = measure(session.prepare(feeds), budget_s=0.3, warmup=3)
        except AttnExportError as e:
            figures[name] = {"error": str(e)}
            continue
        timings[name] = stats
        figures[name] = {
            "p50_ms": stats.p50_ms,
            "p90_ms": stats.p90_ms,
            "max_abs_error": max(c.max_abs_error for c in comparisons),
            "within_tolerance": all(c.passed for c in comparisons),
            "noise": noise(stats),
        }
    passing = [n for n, f in figures.items() if f.get("within_tolerance")]
    if not passing:
        raise GraphCheckError(f"{spec.name}: auto found no variant within the model's tolerance: {figures}")
    fastest = min(passing, key=lambda n: figures[n]["p50_ms"])
    base = "fp32" if "fp32" in passing else fastest
    noisy = noise(*(timings[n] for n in passing))
    if noisy:
        chosen, why = base, f"timings {noisy}: kept {base}"
    elif fastest != base and not clearly_faster(timings[fastest], timings[base]):
        chosen, why = base, f"{fastest} is not faster than {base} beyond the noise (its p90 >= {base}'s p50)"
    else:
        chosen, why = fastest, "fastest within the model's tolerance"
    info = {"chosen": chosen, "why": why, "provider": provider, "shape": dict(spec.typical), "figures": figures}
    return chosen, info


def _checked_graph(ctx: _SpecBuild, variant: str, result: BuildResult) -> tuple[_Graph, dict[str, Any]]:
    """The variant's graph through every check (fully masked rows repaired where they
    differ from PyTorch), and what its making recorded; the stages fill ``result``."""
    spec = ctx.spec
    with _stage(result, "module"):
        ctx.module.get()
    with _stage(result, "masks"):
        ctx.masks.get()
    with _stage(result, "export"):
        ctx.export(spec.opset)
    with _stage(result, "variant"):
        if VARIANTS[variant].chooser:
            chosen, info = _auto_choice(ctx)
            graph = ctx.graph(chosen)
        else:
            graph = ctx.graph(variant)
            info = graph.info
    result.warnings += graph.warnings
    result.stages["checker"] = result.stages["axes"] = True  # checked when the graph was made
    with _stage(result, "smoke"):
        ctx.smoke(variant, graph.model)
    with _stage(result, "fully_masked"):
        model, masked = settle(
            spec, variant_key(spec.name, variant), graph.model, ctx.golden.get(), spec.tolerances(variant)
        )
        if model is not graph.model:
            ctx.smoke(variant, model)  # the repaired graph, checked like any other
        info = {**info, **({"fully_masked": masked} if masked else {})}
        graph = dataclasses.replace(graph, model=model)
    return graph, info


def _build_variant(ctx: _SpecBuild, variant: str, manifest: Manifest, result: BuildResult) -> None:
    spec, out_dir = ctx.spec, ctx.options.out_dir
    key = _build_key(spec, ctx.sources, ctx.vers, variant, ctx.options.provider)
    name = variant_key(spec.name, variant)
    previous = manifest.models.get(name)
    if previous is not None and not ctx.options.force and _up_to_date(previous, key, out_dir):
        result.status, result.file, result.sha256 = "skipped", previous.file, previous.sha256
        result.info = previous.variant_info
        return
    if spec.mode != "eval":
        result.warnings.append(f"spec asks for mode '{spec.mode}'; exported in eval mode (dropout off)")

    graph, info = _checked_graph(ctx, variant, result)
    with _stage(result, "write"):
        file, sha = stage(out_dir, f"{name}.onnx", graph.model)
        golden, golden_sha = stage(out_dir, f"{spec.name}.golden.npz", ctx.golden_file.get())
        entry = ManifestEntry(
            name=name,
            file=file,
            sha256=sha,
            golden=golden,
            golden_sha256=golden_sha,
            build_key=key,
            spec_hash=spec.content_hash(),
            sources=ctx.sources,
            versions=ctx.vers,
            spec=spec.to_dict(),
            variant=variant,
            variant_info=info,
        )
        commit(out_dir, manifest, name, entry)
    result.status, result.file, result.sha256 = "built", manifest.models[name].file, sha
    result.info = info


def _open_manifest(out_dir: Path, force: bool) -> Manifest:
    if not (out_dir / "manifest.json").exists():
        return Manifest(__version__)
    try:
        return load_manifest(out_dir)
    except ArtifactError as e:
        if force:
            return Manifest(__version__)
        raise ArtifactError(f"{e}; fix or delete it, or rebuild everything with --force") from e


def _build_spec(path: Path, options: BuildOptions, manifest: Manifest, vers: dict[str, str]) -> Iterator[BuildResult]:
    t0 = time.perf_counter()
    first = BuildResult(name=path.stem)
    try:
        with _stage(first, "spec"):
            spec = load_spec(path)
            overrides = {k: v for k, v in (("opset", options.opset), ("exporter", options.exporter)) if v}
            spec = dataclasses.replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]
    except AttnExportError as e:
        first.error, first.exit_code, first.seconds = str(e), e.exit_code, time.perf_counter() - t0
        yield first
        return
    ctx = _SpecBuild(spec, vers, options)
    for variant in options.variants:
        result = BuildResult(name=variant_key(spec.name, variant), variant=variant)
        result.stages["spec"] = True
        try:
            _build_variant(ctx, variant, manifest, result)
        except AttnExportError as e:
            result.status, result.error, result.exit_code = "failed", str(e), e.exit_code
        result.seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        yield result


def _remove_leftovers(out_dir: Path, manifest: Manifest) -> None:
    """After the last graph, remove the staged files that neither this build's manifest nor
    the one on disk names (a write that failed half-way): no orphans outlive the build."""
    manifests = [manifest]
    with contextlib.suppress(ArtifactError):
        manifests.append(load_manifest(out_dir))
    with contextlib.suppress(OSError):
        remove_leftovers(out_dir, *manifests)


def build_models(
    spec_paths: Sequence[Path],
    options: BuildOptions,
    on_result: Callable[[BuildResult], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> BuildSummary:
    """Build each spec file's variants into ``options.out_dir``; a failing graph never
    raises, it becomes a failed result. ``on_notice`` hears, in one line each, that the
    build waits for the folder's lock and that an interrupted build was cleaned up."""
    unknown = [v for v in options.variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    started = time.perf_counter()
    results: list[BuildResult] = []
    with build_lock(options.out_dir, options.lock_wait_s, on_notice):
        manifest = _open_manifest(options.out_dir, options.force)
        notice = recover(options.out_dir, manifest)
        if notice and on_notice:
            on_notice(notice)
        vers = versions()
        try:
            for path in spec_paths:
                for result in _build_spec(path, options, manifest, vers):
                    results.append(result)
                    if on_result:
                        on_result(result)
                    if options.fail_fast and not result.ok:
                        break
                if options.fail_fast and results and not results[-1].ok:
                    break
        finally:
            _remove_leftovers(options.out_dir, manifest)
    return BuildSummary(str(options.out_dir), results, time.perf_counter() - started)


def export_module(module: Any, spec: ModelSpec, path: Path) -> BuildResult:
    """A module in hand through build's stages (mask probe, export, graph checks, smoke
    check, fully masked rows) and written to ``path``, without manifest or golden file;
    the first failing stage raises."""
    ctx = _SpecBuild(spec, versions(), BuildOptions(path.parent))
    ctx.module = _Once(lambda: module)
    result = BuildResult(name=spec.name)
    result.stages["spec"] = True
    graph, info = _checked_graph(ctx, "fp32", result)
    with _stage(result, "write"):
        atomic_write(path, graph.model)
    result.status, result.file, result.sha256, result.info = "built", str(path), sha256_bytes(graph.model), info
    return result
