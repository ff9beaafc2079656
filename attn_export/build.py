"""The build pipeline: spec -> module -> ONNX -> variants -> checks -> smoke run ->
artifacts + manifest.

Each (model, variant) fills a ``BuildResult``; one failing does not stop the others unless
``fail_fast``. Artifacts are written only after every check passed, each atomically, and
the manifest is rewritten after every graph so it always matches the files on disk.
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
from attn_export.artifacts.files import atomic_write, build_lock, sha256_bytes, sha256_file
from attn_export.artifacts.golden import GoldenCase, write_golden
from attn_export.artifacts.manifest import Manifest, ManifestEntry, load_manifest, save_manifest
from attn_export.compare import compare_outputs
from attn_export.errors import ArtifactError, AttnExportError, ExportFailure, GraphCheckError, UsageError
from attn_export.export.factory import instantiate
from attn_export.export.graph_checks import check_dynamic_axes, check_model
from attn_export.export.torch_export import export_onnx, stamp_metadata
from attn_export.export.variants import make_variant
from attn_export.fully_masked import settle
from attn_export.mask_probe import check_masks
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.spec import VARIANTS, ModelSpec, load_spec, variant_key
from attn_export.spec.inputs import make_feeds
from attn_export.spec.masks import CASES
from attn_export.spec.shapes import ShapePoint, example_sizes, golden_points
from attn_export.spec.variants import auto_candidates
from attn_export.timing import measure, physical_cores

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
        self.module = _Once(lambda: instantiate(spec))
        self.masks = _Once(self._check_masks)
        self.exports: dict[int, _Once[onnx.ModelProto]] = {}
        self.example = _Once(self._example)
        self.golden = _Once(self._golden_cases)
        self.graphs: dict[str, _Once[_Graph]] = {}
        #: sha256 of the golden file once this build has written it (shared by all variants).
        self.golden_sha256: str | None = None

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
        proto = export_onnx(self.module.get(), self.spec, example, opset=opset)
        check_model(proto, self.spec.name)
        check_dynamic_axes(proto, self.spec.name, self.spec.inputs, self.spec.outputs)
        return proto

    def _cases(self, points: list[ShapePoint], first_seed: int) -> list[GoldenCase]:
        spec = self.spec
        cases = []
        with TorchRuntime(self.module.get(), spec.inputs, spec.outputs, spec.dims) as eager:
            for i, p in enumerate(points):
                feeds = make_feeds(spec, p.sizes, first_seed + i, case=p.case)
                cases.append(GoldenCase(p.label, dict(p.sizes), feeds, eager.run(feeds)))
        return cases

    def _example(self) -> GoldenCase:
        return self._cases([ShapePoint("example", self.sizes)], BUILD_SEED)[0]

    def _golden_cases(self) -> list[GoldenCase]:
        """PyTorch's outputs at the golden shapes and the named mask cases (recorded; the
        shapes are smoke-checked, the mask cases settle fully masked rows)."""
        return self._cases(golden_points(self.spec), BUILD_SEED + 1)

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
        check_dynamic_axes(proto, key, spec.inputs, spec.outputs)
        return _Graph(proto.SerializeToString(deterministic=True), graph.info, graph.warnings)

    def smoke(self, variant: str, model: bytes) -> None:
        """ONNX Runtime (CPU) against PyTorch at the example and golden shapes, at the
        variant's tolerance."""
        spec = self.spec
        tolerances = spec.tolerances(variant)
        cases = [c for c in self.golden.get() if c.label not in CASES]
        with OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, provider="cpu") as session:
            for case in [self.example.get(), *cases]:
                failed = [c.reason() for c in compare_outputs(case.outputs, session.run(case.inputs), tolerances)]
                failed = [r for r in failed if r]
                if failed:
                    shape = ",".join(f"{k}={v}" for k, v in case.sizes.items())
                    raise GraphCheckError(
                        f"{variant_key(spec.name, variant)}: smoke check at {case.label} ({shape}) failed: {failed[0]}"
                    )


def _build_key(spec: ModelSpec, vers: dict[str, str], variant: str, provider: str) -> str:
    target = provider if VARIANTS[variant].provider_dependent else None
    blob = json.dumps(
        {"spec": spec.content_hash(), "versions": vers, "variant": variant, "provider": target}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _up_to_date(entry: ManifestEntry | None, key: str, out_dir: Path) -> bool:
    if entry is None or entry.build_key != key:
        return False
    try:
        return (
            sha256_file(out_dir / entry.file) == entry.sha256
            and sha256_file(out_dir / entry.golden) == entry.golden_sha256
        )
    except ArtifactError:
        return False


def _auto_choice(ctx: _SpecBuild) -> tuple[str, dict[str, Any]]:
    """Time each candidate at the spec's typical shape; the fastest within the model's own
    tolerance wins. Candidates that fail to build or to agree are recorded, not chosen."""
    spec, provider = ctx.spec, ctx.options.provider
    feeds = make_feeds(spec, spec.typical, BUILD_SEED)
    with TorchRuntime(ctx.module.get(), spec.inputs, spec.outputs, spec.dims) as eager:
        expected = eager.run(feeds)
    tolerances = spec.tolerances("auto")
    figures: dict[str, dict[str, Any]] = {}
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
        figures[name] = {
            "p50_ms": stats.p50_ms,
            "p90_ms": stats.p90_ms,
            "max_abs_error": max(c.max_abs_error for c in comparisons),
            "within_tolerance": all(c.passed for c in comparisons),
        }
    passing = [n for n, f in figures.items() if f.get("within_tolerance")]
    if not passing:
        raise GraphCheckError(f"{spec.name}: auto found no variant within the model's tolerance: {figures}")
    chosen = min(passing, key=lambda n: figures[n]["p50_ms"])
    return chosen, {"chosen": chosen, "provider": provider, "shape": dict(spec.typical), "figures": figures}


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
    key = _build_key(spec, ctx.vers, variant, ctx.options.provider)
    name = variant_key(spec.name, variant)
    previous = manifest.models.get(name)
    if previous is not None and not ctx.options.force and _up_to_date(previous, key, out_dir):
        result.status, result.file, result.sha256 = "skipped", previous.file, previous.sha256
        result.info = previous.variant_info
        return
    if spec.mode != "eval":
        result.warnings.append(f"spec asks for mode '{spec.mode}'; exported in eval mode (dropout off)")

    graph, info = _checked_graph(ctx, variant, result)
    golden_name = f"{spec.name}.golden.npz"
    with _stage(result, "write"):
        atomic_write(out_dir / f"{name}.onnx", graph.model)
        if ctx.golden_sha256 is None:
            write_golden(out_dir / golden_name, ctx.golden.get())
            ctx.golden_sha256 = sha256_file(out_dir / golden_name)
        manifest.models[name] = ManifestEntry(
            name=name,
            file=f"{name}.onnx",
            sha256=sha256_bytes(graph.model),
            golden=golden_name,
            golden_sha256=ctx.golden_sha256,
            build_key=key,
            spec_hash=spec.content_hash(),
            versions=ctx.vers,
            spec=spec.to_dict(),
            variant=variant,
            variant_info=info,
        )
        save_manifest(out_dir, manifest)
    result.status, result.file, result.sha256 = "built", f"{name}.onnx", manifest.models[name].sha256
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


def build_models(
    spec_paths: Sequence[Path],
    options: BuildOptions,
    on_result: Callable[[BuildResult], None] | None = None,
) -> BuildSummary:
    """Build each spec file's variants into ``options.out_dir``; a failing graph never
    raises, it becomes a failed result."""
    unknown = [v for v in options.variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    started = time.perf_counter()
    results: list[BuildResult] = []
    with build_lock(options.out_dir):
        manifest = _open_manifest(options.out_dir, options.force)
        vers = versions()
        for path in spec_paths:
            for result in _build_spec(path, options, manifest, vers):
                results.append(result)
                if on_result:
                    on_result(result)
                if options.fail_fast and not result.ok:
                    break
            if options.fail_fast and results and not results[-1].ok:
                break
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
