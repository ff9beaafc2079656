"""Build's cell: one spec file's graphs (every asked-for variant, sharing one export), a pure
function of a frozen input that any executor (``attn_export.executors``) may run.

A cell writes its files only under their staged names (``artifacts.folder.stage``:
content-addressed, atomic, named by no manifest) and returns each graph's manifest entry;
the build commits the entries in spec order under the folder's lock, so the folder ends the
same whichever executor ran the cells, and a cell that dies leaves only leftovers the
build removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.folder import stage
from attn_export.artifacts.golden import GOLDEN_FORMAT
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.checks.fully_masked import settle
from attn_export.errors import ArtifactError, AttnExportError, GraphCheckError, RuntimeFailure, SpecError
from attn_export.executors import exit_if_orphaned
from attn_export.exporter.factory import build_config
from attn_export.exporter.variants.gqa_rotary import refuse_heads
from attn_export.model_spec import ModelSpec, load_spec, variant_chain, variant_key
from attn_export.model_spec.cache import counted_positions
from attn_export.model_spec.shapes import format_sizes
from attn_export.model_spec.tolerance import on_a_cpu
from attn_export.pipelines.building.auto import auto_choice
from attn_export.pipelines.building.graphs import Graph, SpecBuild
from attn_export.pipelines.building.results import BuildOptions, BuildResult
from attn_export.runtimes.ort import crash_on_load

__all__ = ["BuildCell", "BuiltGraph", "build_cell", "checked_graph", "stage_timer"]


@dataclass(frozen=True)
class BuildCell:
    """What a worker needs to build one spec file's graphs: the folder's entries of its
    graphs as the build found them decide which are up to date."""

    path: Path
    options: BuildOptions
    versions: Mapping[str, str]
    previous: Mapping[str, ManifestEntry]


@dataclass
class BuiltGraph:
    """One graph's result, and its entry naming staged files (None: nothing to commit)."""

    result: BuildResult
    entry: ManifestEntry | None = None


@contextlib.contextmanager
def stage_timer(result: BuildResult, name: str) -> Iterator[None]:
    """Mark a stage failed while it runs and passed once it returns."""
    result.stages[name] = False
    yield
    result.stages[name] = True


def _build_key(spec: ModelSpec, sources: dict[str, str], vers: Mapping[str, str], variant: str, provider: str) -> str:
    """What a graph depends on: the spec and weights, the module's source files, the tool
    versions, the variant (a chain's every link, in order), where a link depends on it, the
    provider, and what a golden file records (``GOLDEN_FORMAT``)."""
    target = provider if variant_chain(variant).provider_dependent else None
    blob = json.dumps(
        {
            "spec": spec.content_hash(),
            "sources": sources,
            "versions": dict(vers),
            "variant": variant,
            "provider": target,
            "golden": GOLDEN_FORMAT,
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


def checked_graph(ctx: SpecBuild, variant: str, result: BuildResult) -> tuple[Graph, dict[str, Any]]:
    """The variant's graph through every check (fully masked rows repaired where they
    differ from PyTorch), and what its making recorded; the stages fill ``result``."""
    spec = ctx.spec
    with stage_timer(result, "spec"):  # said before any export
        if variant_chain(variant).in_place and spec.cache_max_seq is None:
            raise SpecError(
                f"{variant_key(spec.name, variant)}: a cache updated in place needs its capacity: "
                "declare [cache] max_seq in the spec"
            )
        if variant_chain(variant).counts_positions:
            counted_positions(spec, variant_key(spec.name, variant), build_config(spec))
            refuse_heads(spec, variant_key(spec.name, variant))
        ctx.check_budget()
    with stage_timer(result, "module"):
        ctx.module.get()
    with stage_timer(result, "masks"):
        ctx.masks.get()
    with stage_timer(result, "export"):
        ctx.export(spec.opset)
    result.warnings += [
        f"accepted guard {g.describe()}: smoke-checked and verified where it fails, at "
        + "; ".join(format_sizes(p) for p in g.points)
        if g.points
        else f"accepted guard {g.describe()}: NOT checked (the guards before it took every size build "
        "checks for guards); verify it with --shapes at sizes where it fails"
        for g in ctx.spec.guards
    ]
    with stage_timer(result, "variant"):
        if variant_chain(variant).chooser:
            chosen, info = auto_choice(ctx)
            graph = ctx.graph(chosen)
        else:
            graph = ctx.graph(variant)
            info = graph.info
    result.warnings += graph.warnings
    result.stages["checker"] = result.stages["axes"] = True  # checked when the graph was made
    if variant != "fp32":  # a rewritten graph may crash ONNX Runtime itself: fail it, not the build
        with stage_timer(result, "load"):
            crash = crash_on_load(graph.model)
        if crash:
            raise GraphCheckError(
                f"{variant_key(ctx.spec.name, variant)}: ONNX Runtime {crash} making a session of this graph (on "
                "the CPU, its default optimizations): a crash inside ONNX Runtime, not an error it reports; not kept"
            )
    with stage_timer(result, "golden"):  # PyTorch's outputs, which every check after it judges by
        ctx.example.get()
        ctx.golden.get()
    # Fully masked rows are settled first: a graph that differs from PyTorch only there (as
    # float16 rounds a masked row away from uniform) is smoke-checked as repaired.
    with stage_timer(result, "fully_masked"):
        try:
            model, masked = settle(
                spec,
                variant_key(spec.name, variant),
                graph.model,
                ctx.golden.get(),
                on_a_cpu(spec.tolerances(variant), spec.simulated_tolerances(variant)),  # settled on the CPU
                lambda: ctx.export(spec.opset).SerializeToString(),
            )
        except (GraphCheckError, RuntimeFailure):
            with stage_timer(result, "smoke"):
                ctx.smoke(variant, graph.model)  # a graph wrong (or refused) in rows that see keys says that first
            raise
        info = {**info, **({"fully_masked": masked} if masked else {})}
        graph = dataclasses.replace(graph, model=model)
    with stage_timer(result, "smoke"):
        ctx.smoke(variant, graph.model)
    result.stages["load"] = True  # the plain export is loaded by the smoke check itself
    return graph, info


def _stage(out_dir: Path, stable: str, data: bytes) -> tuple[str, str]:
    """``stage``, unless this cell's build has died: its folder's lock died with it, and the
    folder is another build's to write."""
    exit_if_orphaned()
    return stage(out_dir, stable, data)


def _build_variant(ctx: SpecBuild, variant: str, previous: ManifestEntry | None, result: BuildResult) -> BuiltGraph:
    spec, options = ctx.spec, ctx.options
    out_dir = options.out_dir
    key = _build_key(spec, ctx.sources, ctx.vers, variant, options.provider)
    if previous is not None and not options.force and _up_to_date(previous, key, options):
        result.status, result.file, result.sha256 = "skipped", previous.file, previous.sha256
        result.info = previous.variant_info
        return BuiltGraph(result)
    if spec.mode != "eval":
        result.warnings.append(f"spec asks for mode '{spec.mode}'; exported in eval mode (dropout off)")

    graph, info = checked_graph(ctx, variant, result)
    spec = ctx.spec  # as built: with the guards its export accepted
    name = variant_key(spec.name, variant)
    with stage_timer(result, "write"):
        file, sha = _stage(out_dir, f"{name}.onnx", graph.model)
        golden, golden_sha = _stage(out_dir, f"{spec.name}.golden.npz", ctx.golden_file.get())
        recorded, why_not = (None, None)
        if options.record_intermediates:
            recorded, why_not = ctx.intermediates(variant, graph.model)
            result.warnings += [why_not] if why_not else []
        inter, inter_sha = _stage(out_dir, f"{name}.intermediates.npz", recorded) if recorded else ("", "")
        generated, why_not = ctx.generations.get()
        result.warnings += [why_not] if why_not else []
        gen, gen_sha = _stage(out_dir, f"{spec.name}.generate.npz", generated) if generated else ("", "")
        entry = ManifestEntry(
            name=name,
            file=file,
            sha256=sha,
            golden=golden,
            golden_sha256=golden_sha,
            build_key=key,
            spec_hash=spec.content_hash(),
            sources=ctx.sources,
            versions=dict(ctx.vers),
            spec=spec.to_dict(),
            variant=variant,
            variant_info=info,
            intermediates=inter,
            intermediates_sha256=inter_sha,
            generations=gen,
            generations_sha256=gen_sha,
        )
    result.status, result.sha256, result.info = "built", sha, info
    return BuiltGraph(result, entry)


def _traceback(error: BaseException, kept: bool) -> str:
    """``error``'s traceback with the errors it was raised from, where ``kept``."""
    return "".join(traceback.format_exception(error)) if kept else ""


def build_cell(cell: BuildCell) -> list[BuiltGraph]:
    """The spec file's graphs in variant order, each built and staged or found up to date;
    a failing graph becomes a failed result, and with ``fail_fast`` the last one."""
    options = cell.options
    t0 = time.perf_counter()
    first = BuildResult(name=cell.path.stem)
    try:
        with stage_timer(first, "spec"):
            spec = load_spec(cell.path)
            overrides = {k: v for k, v in (("opset", options.opset), ("exporter", options.exporter)) if v}
            spec = dataclasses.replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]
            ctx = SpecBuild(spec, dict(cell.versions), options)  # its example sizes, or why there are none
    except AttnExportError as e:
        first.error, first.exit_code, first.seconds = str(e), e.exit_code, time.perf_counter() - t0
        first.traceback = _traceback(e, options.debug)
        return [BuiltGraph(first)]
    built = []
    for variant in options.variants:
        name = variant_key(spec.name, variant)
        result = BuildResult(name=name, variant=variant)
        result.stages["spec"] = True
        try:
            graph = _build_variant(ctx, variant, cell.previous.get(name), result)
        except AttnExportError as e:
            result.status, result.error, result.exit_code = "failed", str(e), e.exit_code
            result.traceback = _traceback(e, options.debug)
            graph = BuiltGraph(result)
        result.seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        built.append(graph)
        if options.fail_fast and not result.ok:
            break
    return built
