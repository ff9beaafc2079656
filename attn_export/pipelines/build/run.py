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
from pathlib import Path
from typing import Any

from attn_export import __version__
from attn_export.artifacts.files import build_lock, sha256_bytes, sha256_file, write_output
from attn_export.artifacts.folder import commit, recover, remove_leftovers, stage
from attn_export.artifacts.manifest import Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.provenance import versions
from attn_export.checks.fully_masked import settle
from attn_export.errors import (
    ArtifactError,
    AttnExportError,
    UsageError,
)
from attn_export.pipelines.build.auto import auto_choice
from attn_export.pipelines.build.graphs import Graph, Once, SpecBuild
from attn_export.pipelines.build.results import BuildOptions, BuildResult, BuildSummary
from attn_export.spec import VARIANTS, ModelSpec, load_spec, variant_key

__all__ = ["build_models", "export_module"]


@contextlib.contextmanager
def _stage(result: BuildResult, name: str) -> Iterator[None]:
    """Mark a stage failed while it runs and passed once it returns."""
    result.stages[name] = False
    yield
    result.stages[name] = True


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


def _up_to_date(entry: ManifestEntry | None, key: str, options: BuildOptions) -> bool:
    """The entry was built from the same inputs, its files are intact, and it holds
    intermediates if they are asked for."""
    out_dir = options.out_dir
    if entry is None or entry.build_key != key or (options.record_intermediates and not entry.intermediates):
        return False
    try:
        return all(sha256_file(out_dir / name, out_dir) == sha for name, sha in entry.files())
    except ArtifactError:
        return False


def _checked_graph(ctx: SpecBuild, variant: str, result: BuildResult) -> tuple[Graph, dict[str, Any]]:
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
            chosen, info = auto_choice(ctx)
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


def _build_variant(ctx: SpecBuild, variant: str, manifest: Manifest, result: BuildResult) -> None:
    spec, out_dir = ctx.spec, ctx.options.out_dir
    key = _build_key(spec, ctx.sources, ctx.vers, variant, ctx.options.provider)
    name = variant_key(spec.name, variant)
    previous = manifest.models.get(name)
    if previous is not None and not ctx.options.force and _up_to_date(previous, key, ctx.options):
        result.status, result.file, result.sha256 = "skipped", previous.file, previous.sha256
        result.info = previous.variant_info
        return
    if spec.mode != "eval":
        result.warnings.append(f"spec asks for mode '{spec.mode}'; exported in eval mode (dropout off)")

    graph, info = _checked_graph(ctx, variant, result)
    with _stage(result, "write"):
        file, sha = stage(out_dir, f"{name}.onnx", graph.model)
        golden, golden_sha = stage(out_dir, f"{spec.name}.golden.npz", ctx.golden_file.get())
        recorded, why_not = (None, None)
        if ctx.options.record_intermediates:
            recorded, why_not = ctx.intermediates(variant, graph.model)
            result.warnings += [why_not] if why_not else []
        inter, inter_sha = stage(out_dir, f"{name}.intermediates.npz", recorded) if recorded else ("", "")
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
            intermediates=inter,
            intermediates_sha256=inter_sha,
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
    ctx = SpecBuild(spec, vers, options)
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
    options.check()
    stems = [p.stem for p in spec_paths]
    twice = next((s for s in stems if stems.count(s) > 1), None)
    if twice is not None:
        both = " and ".join(str(p) for p in spec_paths if p.stem == twice)
        raise UsageError(f"{both} both name model '{twice}': one build folder holds one model of a name")
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
    ctx = SpecBuild(spec, versions(), BuildOptions(path.parent))
    ctx.module = Once(lambda: module)
    result = BuildResult(name=spec.name)
    result.stages["spec"] = True
    graph, info = _checked_graph(ctx, "fp32", result)
    with _stage(result, "write"):
        write_output(path, graph.model)
    result.status, result.file, result.sha256, result.info = "built", str(path), sha256_bytes(graph.model), info
    return result
