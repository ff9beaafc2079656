"""The build pipeline: spec -> module -> ONNX -> checks -> smoke run -> artifacts + manifest.

Each model's stages fill a ``BuildResult``; one model failing does not stop the others
unless ``fail_fast``. Artifacts are written only after every check passed, each atomically,
and the manifest is rewritten after every model so it always matches the files on disk.
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

import numpy as np
import onnx

from attn_export import __version__
from attn_export._deps import require
from attn_export.artifacts import atomic_write, build_lock, sha256_bytes, sha256_file, write_golden
from attn_export.compare import compare_outputs
from attn_export.errors import ArtifactError, AttnExportError, GraphCheckError
from attn_export.export import export_onnx, stamp_metadata
from attn_export.factory import instantiate
from attn_export.graph_checks import check_dynamic_axes, check_model
from attn_export.inputs import make_feeds
from attn_export.manifest import Manifest, ManifestEntry, load_manifest, save_manifest
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.shapes import ShapePoint, example_sizes, golden_points
from attn_export.spec import ModelSpec, load_spec

__all__ = ["BuildOptions", "BuildResult", "BuildSummary", "build_models", "versions"]

#: Feeds for export examples and golden vectors use this seed (recorded in the golden file).
BUILD_SEED = 0
STAGES = ("spec", "module", "export", "checker", "axes", "smoke", "write")


@dataclass
class BuildOptions:
    """What ``attn-export build`` was asked to do."""

    out_dir: Path
    opset: int | None = None
    exporter: str | None = None
    force: bool = False
    fail_fast: bool = False


@dataclass
class BuildResult:
    """One model's build: each stage True (passed), False (failed) or None (did not run)."""

    name: str
    status: str = "failed"  # built | skipped | failed
    seconds: float = 0.0
    file: str | None = None
    sha256: str | None = None
    error: str | None = None
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)
    stages: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(STAGES))

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@dataclass
class BuildSummary:
    """All results of one build run."""

    out_dir: str
    results: list[BuildResult]
    seconds: float

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.results), default=0)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in ("built", "skipped", "failed")}

    def to_dict(self) -> dict[str, object]:
        return {
            "out_dir": self.out_dir,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "exit_code": self.exit_code,
            "results": [dataclasses.asdict(r) for r in self.results],
        }


def versions() -> dict[str, str]:
    """Versions that shape an exported graph; recorded in metadata and the manifest."""
    torch = require("torch", "building")
    onnxscript = require("onnxscript", "building")
    return {
        "attn_export": __version__,
        "torch": str(torch.__version__),
        "onnx": onnx.__version__,
        "onnxscript": str(getattr(onnxscript, "__version__", "unknown")),
    }


@contextlib.contextmanager
def _stage(result: BuildResult, name: str) -> Iterator[None]:
    """Mark a stage failed while it runs and passed once it returns."""
    result.stages[name] = False
    yield
    result.stages[name] = True


def _build_key(spec: ModelSpec, vers: dict[str, str]) -> str:
    blob = json.dumps({"spec": spec.content_hash(), "versions": vers}, sort_keys=True)
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


def _smoke(spec: ModelSpec, module: object, model: bytes, points: list[ShapePoint]):
    """Run PyTorch and ONNX Runtime at each point; return golden cases, raise on mismatch."""
    tolerances = {t.name: spec.tolerance_for(t.name) for t in spec.outputs}
    cases = []
    with (
        TorchRuntime(module, spec.inputs, spec.outputs, spec.dims) as eager,
        OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, provider="cpu") as ort_cpu,
    ):
        for i, point in enumerate(points):
            feeds = make_feeds(spec, point.sizes, BUILD_SEED + i)
            expected = eager.run(feeds)
            actual = ort_cpu.run(feeds)
            failed = [c.reason() for c in compare_outputs(expected, actual, tolerances) if not c.passed]
            if failed:
                raise GraphCheckError(
                    f"{spec.name}: smoke check at {point.label} ({point.describe()}) failed: {failed[0]}"
                )
            cases.append((point.label, point.sizes, feeds, expected))
    return cases


def _build_one(
    spec: ModelSpec, out_dir: Path, manifest: Manifest, vers: dict[str, str], force: bool, result: BuildResult
) -> None:
    key = _build_key(spec, vers)
    previous = manifest.models.get(spec.name)
    if not force and _up_to_date(previous, key, out_dir):
        result.status, result.file, result.sha256 = "skipped", previous.file, previous.sha256  # type: ignore[union-attr]
        return
    if spec.mode != "eval":
        result.warnings.append(f"spec asks for mode '{spec.mode}'; exported in eval mode (dropout off)")

    with _stage(result, "module"):
        module = instantiate(spec)
    sizes = example_sizes(spec)
    example = make_feeds(spec, sizes, BUILD_SEED, masked_row=False)
    with _stage(result, "export"):
        proto = export_onnx(module, spec, example)
    stamp_metadata(
        proto,
        {
            "attn_export.model": spec.name,
            "attn_export.source_module": spec.module,
            "attn_export.spec_hash": spec.content_hash(),
            "attn_export.exporter": spec.exporter,
            "attn_export.opset": str(spec.opset),
            **{f"attn_export.version.{k}": v for k, v in vers.items()},
        },
    )
    with _stage(result, "checker"):
        check_model(proto, spec.name)
    with _stage(result, "axes"):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs)
    model_bytes = proto.SerializeToString(deterministic=True)
    with _stage(result, "smoke"):
        cases = _smoke(spec, module, model_bytes, [ShapePoint("example", sizes), *golden_points(spec)])

    onnx_name, golden_name = f"{spec.name}.onnx", f"{spec.name}.golden.npz"
    with _stage(result, "write"):
        atomic_write(out_dir / onnx_name, model_bytes)
        write_golden(out_dir / golden_name, cases[1:])
        manifest.models[spec.name] = ManifestEntry(
            name=spec.name,
            file=onnx_name,
            sha256=sha256_bytes(model_bytes),
            golden=golden_name,
            golden_sha256=sha256_file(out_dir / golden_name),
            opset=spec.opset,
            exporter=spec.exporter,
            build_key=key,
            spec_hash=spec.content_hash(),
            inputs=[t.to_dict() for t in spec.inputs],
            outputs=[t.to_dict() for t in spec.outputs],
            dims={k: dataclasses.asdict(v) for k, v in spec.dims.items()},
            tolerance=spec.to_dict()["tolerance"],
            versions=vers,
            spec=spec.to_dict(),
        )
        save_manifest(out_dir, manifest)
    result.status, result.file, result.sha256 = "built", onnx_name, manifest.models[spec.name].sha256


def _open_manifest(out_dir: Path, force: bool) -> Manifest:
    if not (out_dir / "manifest.json").exists():
        return Manifest(__version__)
    try:
        return load_manifest(out_dir)
    except ArtifactError as e:
        if force:
            return Manifest(__version__)
        raise ArtifactError(f"{e}; fix or delete it, or rebuild everything with --force") from e


def build_models(
    spec_paths: Sequence[Path],
    options: BuildOptions,
    on_result: Callable[[BuildResult], None] | None = None,
) -> BuildSummary:
    """Build each spec file into ``options.out_dir``; never raises for a single model's failure."""
    started = time.perf_counter()
    results: list[BuildResult] = []
    with build_lock(options.out_dir):
        manifest = _open_manifest(options.out_dir, options.force)
        vers = versions()
        for path in spec_paths:
            t0 = time.perf_counter()
            result = BuildResult(name=path.stem)
            try:
                with _stage(result, "spec"):
                    spec = load_spec(path)
                result.name = spec.name
                overrides = {k: v for k, v in (("opset", options.opset), ("exporter", options.exporter)) if v}
                spec = dataclasses.replace(spec, **overrides) if overrides else spec
                _build_one(spec, options.out_dir, manifest, vers, options.force, result)
            except AttnExportError as e:
                result.status, result.error, result.exit_code = "failed", str(e), e.exit_code
            result.seconds = time.perf_counter() - t0
            results.append(result)
            if on_result:
                on_result(result)
            if options.fail_fast and not result.ok:
                break
    return BuildSummary(str(options.out_dir), results, time.perf_counter() - started)
