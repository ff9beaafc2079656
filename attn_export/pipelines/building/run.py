"""The build pipeline: spec -> module -> ONNX -> variants -> checks -> smoke run ->
artifacts + manifest.

Each spec file is a cell (``cells.py``) that builds its variants and stages their files;
each (model, variant) fills a ``BuildResult``; one failing does not stop the others unless
``fail_fast``. Artifacts are written only after every check passed, and committed graph by
graph through the manifest (``artifacts.folder``), so an interrupted build leaves every
graph's previous or new build, never a mix.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attn_export import __version__
from attn_export.artifacts.files import build_lock, resolved, sha256_bytes, sha256_file, write_output
from attn_export.artifacts.folder import commit, recover, remove_leftovers
from attn_export.artifacts.genai_folder import (
    GENAI_DIR,
    genai_config,
    provider_note,
    refuse_unfit,
    right_padded_window,
    write_genai_folder,
)
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, load_manifest, save_manifest
from attn_export.artifacts.provenance import versions
from attn_export.errors import ArtifactError, AttnExportError, OptionError, UsageError
from attn_export.executors import SERIAL, Parallelism, run_in_order
from attn_export.exporter.factory import build_config
from attn_export.exporter.variants.static_cache import fed_by_genai
from attn_export.model_spec import ModelSpec, load_spec, variant_chain
from attn_export.model_spec.cache import cache_of, short_window
from attn_export.pipelines.building.cells import BuildCell, BuiltGraph, build_cell, checked_graph, stage_timer
from attn_export.pipelines.building.graphs import Once, SpecBuild
from attn_export.pipelines.building.results import BuildOptions, BuildResult, BuildSummary

__all__ = ["build_models", "export_module"]


def _open_manifest(out_dir: Path, force: bool) -> Manifest:
    if not (out_dir / "manifest.json").exists():
        return Manifest(__version__)
    try:
        return load_manifest(out_dir)
    except ArtifactError as e:
        if force:
            return Manifest(__version__)
        raise ArtifactError(f"{e}; fix or delete it, or rebuild everything with --force") from e


def _remove_leftovers(out_dir: Path, manifest: Manifest) -> None:
    """After the last graph, remove the staged files that neither this build's manifest nor
    the one on disk names (a write that failed half-way): no orphans outlive the build."""
    manifests = [manifest]
    with contextlib.suppress(ArtifactError):
        manifests.append(load_manifest(out_dir))
    with contextlib.suppress(OSError):
        remove_leftovers(out_dir, *manifests)


def _commit(out_dir: Path, manifest: Manifest, graph: BuiltGraph) -> BuildResult:
    """A cell's graph made part of the folder (under the build's lock)."""
    result = graph.result
    if graph.entry is not None:
        try:
            commit(out_dir, manifest, result.name, graph.entry)
        except AttnExportError as e:
            result.status, result.error, result.exit_code = "failed", str(e), e.exit_code
            result.stages["write"] = False
            return result
        result.file = manifest.models[result.name].file
    return result


def _loads(path: Path) -> bool:
    try:
        load_spec(path)
    except AttnExportError:
        return False
    return True


def build_models(
    spec_paths: Sequence[Path],
    options: BuildOptions,
    on_result: Callable[[BuildResult], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    parallelism: Parallelism = SERIAL,
) -> BuildSummary:
    """Build each spec file's variants into ``options.out_dir``; a failing graph never
    raises, it becomes a failed result. Each spec file is a cell on the executor
    ``parallelism``; results and commits follow the order of ``spec_paths`` whichever ran
    them. ``on_notice`` hears, in one line each, that the build waits for the folder's lock
    and that an interrupted build was cleaned up."""
    options.check()
    timed = [v for v in options.variants if variant_chain(v).chooser]
    if timed and parallelism.parallel:
        alone = "{variants} {value} times its candidates, and timing never runs beside another cell: "
        raise OptionError(alone + "build it with one job on the local executor", ["variants"], value=timed[0])
    stems = [p.stem for p in spec_paths]
    twice = next((s for s in stems if stems.count(s) > 1), None)
    if twice is not None:
        both = " and ".join(str(p) for p in spec_paths if p.stem == twice)
        raise UsageError(f"{both} both name model '{twice}': one build folder holds one model of a name")
    out = resolved(options.out_dir)
    inside = next((p for p in spec_paths if resolved(p).parent.is_relative_to(out)), None)
    if inside is not None:
        code = "{out_dir} {value} holds the spec {inside}: verify runs code only from the checkout, never from "
        code += "a build folder, and would refuse it; give {out_dir} a folder of its own"
        raise OptionError(code, ["out_dir"], value=options.out_dir, inside=inside)
    started = time.perf_counter()
    results: list[BuildResult] = []

    def report(result: BuildResult) -> None:
        results.append(result)
        if on_result:
            on_result(result)

    if options.target == "genai":  # before anything is built: nothing is written for a spec genai cannot run
        for p in spec_paths:
            spec = load_spec(p)
            for variant in options.variants:
                refuse_unfit(spec, variant)
                if on_notice is not None and (note := provider_note(variant, options.provider)):
                    on_notice(f"{spec.name}: --target genai: {note}")
            config = build_config(spec)
            genai_config(spec, config)  # what its config needs (heads, eos, ...) is there
            cache = cache_of(spec)
            batch = cache.batch_dim if cache is not None else None
            padded = batch is None or spec.dims[batch].max > 1  # genai pads a batch of two or more
            if on_notice is not None and padded and (window := short_window(spec, config)) is not None:
                on_notice(f"{spec.name}: --target genai: {right_padded_window(window)}")
    if not any(_loads(p) for p in spec_paths):  # every spec fails before any work: the folder is left alone
        for p in spec_paths:
            for graph in build_cell(BuildCell(p, options, {}, {})):
                report(graph.result)
    else:
        with build_lock(options.out_dir, options.lock_wait_s, on_notice):
            manifest = _open_manifest(options.out_dir, options.force)
            notice = recover(options.out_dir, manifest)
            if notice and on_notice:
                on_notice(notice)
            vers = versions()
            cells = [BuildCell(p, options, vers, dict(manifest.models)) for p in spec_paths]
            try:
                with contextlib.closing(run_in_order(parallelism, build_cell, cells)) as built:
                    for graphs in built:
                        for graph in graphs:
                            report(_commit(options.out_dir, manifest, graph))
                        if options.fail_fast and results and not results[-1].ok:
                            break  # closing cancels the cells not started
                if options.target == "genai":  # under the lock: no other build swaps a graph mid-copy
                    _package_for_genai(spec_paths, options, results)
            finally:
                _remove_leftovers(options.out_dir, manifest)
    written = (options.out_dir / MANIFEST_NAME).is_file()
    return BuildSummary(str(options.out_dir), results, time.perf_counter() - started, written)


def _package_for_genai(spec_paths: Sequence[Path], options: BuildOptions, results: Sequence[BuildResult]) -> None:
    """Each graph built (or unchanged) as ``genai/<graph>/`` beside it, from the manifest's file."""
    if not (options.out_dir / MANIFEST_NAME).is_file():
        return  # nothing was built
    manifest = load_manifest(options.out_dir)
    for path in spec_paths:
        spec = load_spec(path)
        config = None
        for result in results:
            ours = result.name in (spec.name, f"{spec.name}.{result.variant}")
            if not (ours and result.ok and result.name in manifest.models):
                continue
            config = config if config is not None else build_config(spec)
            entry = manifest.models[result.name]
            dest = options.out_dir / GENAI_DIR / result.name
            edit = fed_by_genai(result.variant)
            write_genai_folder(options.out_dir / entry.file, spec, config, dest, result.variant, edit, options.provider)
            entry.genai = {f.name: sha256_file(f, options.out_dir) for f in sorted(dest.iterdir())}
            save_manifest(options.out_dir, manifest)  # each folder's hashes as it is written: verify holds it to them


def export_module(module: Any, spec: ModelSpec, path: Path) -> BuildResult:
    """A module in hand through build's stages (mask probe, export, graph checks, smoke
    check, fully masked rows) and written to ``path``, without manifest or golden file;
    the first failing stage raises."""
    ctx = SpecBuild(spec, versions(), BuildOptions(path.parent))
    ctx.module = Once(lambda: module)
    result = BuildResult(name=spec.name)
    result.stages["spec"] = True
    graph, info = checked_graph(ctx, "fp32", result)
    with stage_timer(result, "write"):
        write_output(path, graph.model)
    result.status, result.file, result.sha256, result.info = "built", str(path), sha256_bytes(graph.model), info
    return result
