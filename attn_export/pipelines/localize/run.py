"""The localize pipeline: a built graph and its checkout spec -> one case's inputs ->
PyTorch's values of every FX node and the graph's values of every ONNX value (one run each)
-> each region run alone on PyTorch's values -> the first region whose own error breaks
the tolerance, with its source line (where the outputs agree too: a fault their tolerance
hides). ``check_regions`` is verify's ``regions`` (``--check-regions``, ``--strict-regions``)."""

from __future__ import annotations

import dataclasses
import heapq
import shlex
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from attn_export.artifacts.bundle import TOLERANCE_KEYS, check_bundle_folder, write_bundle
from attn_export.artifacts.files import read_lock
from attn_export.artifacts.golden import GoldenCase
from attn_export.artifacts.intermediates import read_intermediates
from attn_export.artifacts.manifest import Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.onnx_file import default_opset, load_model_file
from attn_export.artifacts.provenance import versions
from attn_export.artifacts.recorded import RECORDED
from attn_export.checks.causality import sights
from attn_export.checks.decode.plan import DEFAULT_STEPS, Trajectory, layouts, plan_trajectory, step_inputs
from attn_export.checks.decode.run import run_trajectory
from attn_export.checks.fully_masked import judge, padded_rows_agree, padded_tokens
from attn_export.checks.generate import padding_side
from attn_export.compare.outputs import OutputComparison, judge_value
from attn_export.errors import (
    ArtifactError,
    NotLocalizable,
    OptionError,
    RuntimeFailure,
    RunTimeout,
    UsageError,
)
from attn_export.exporter.factory import instantiate
from attn_export.exporter.packed_projections import unpacked
from attn_export.exporter.source import module_sources
from attn_export.exporter.torch_export import export_program
from attn_export.exporter.variants.int4 import int4_compute, quantized_projections, simulated_on
from attn_export.model_spec import ModelSpec, Tolerance, load_spec, variant_chain, variant_key
from attn_export.model_spec.cache import cache_of, fed_sizes
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.masks import CASES, PATTERN
from attn_export.model_spec.memory import check_memory, memory_budget
from attn_export.model_spec.shapes import ShapePoint, check_mask_case, example_sizes, format_sizes, validate_sizes
from attn_export.model_spec.tolerance import on_a_cpu, rounding_bits
from attn_export.pipelines.localize.generate_step import generate_step_case
from attn_export.pipelines.localize.judge import (
    beyond,
    held,
    in_float16,
    left_out,
    nudged,
    region_tolerance,
    representable,
)
from attn_export.pipelines.localize.module_bug import parting_node
from attn_export.pipelines.localize.regions import (
    Region,
    graph_regions,
    has_fx_metadata,
    region_model,
    run_region,
    unpaired,
)
from attn_export.pipelines.localize.results import LocalizeOptions, LocalizeReport, RegionError
from attn_export.pipelines.localize.shrink import shrink_case
from attn_export.pipelines.localize.values import TorchValues, graph_values, simulated_values, torch_values
from attn_export.pipelines.verify.greedy_generations import generation_rounding
from attn_export.pipelines.verify.models import (
    checkout_spec,
    integrity,
    plain_export,
    stale_against_checkout,
    stale_reasons,
)
from attn_export.pipelines.verify.outside import check_described, check_graph_file, outside_manifest, outside_spec
from attn_export.pipelines.verify.results import CaseResult, VerifyOptions, VerifyReport
from attn_export.runtimes import RUNTIMES
from attn_export.runtimes.ort import RUN_TIMEOUT_S, require_provider
from attn_export.runtimes.static_cache import StaticCache, capacity_for
from attn_export.runtimes.target import DEFAULT_RUNTIME, Target
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["LocalizeOptions", "check_regions", "localize_failures", "localize_model"]

#: Exported programs by (spec, module sources, opset): each case localized in this process
#: after the first of its model reuses the export, the costly step (seconds per model).
_PROGRAMS: OrderedDict[tuple[str, tuple[tuple[str, str], ...], int], Any] = OrderedDict()
_KEPT_PROGRAMS = 4


def _program(spec: ModelSpec, module: Any, opset: int) -> Any:
    """The FX program the dynamo exporter converts, as build exported it: exported once
    per model and opset, then reused (the spec and its module's source files are the key)."""
    key = _program_key(spec, opset)
    if key not in _PROGRAMS:
        _keep_program(spec, opset, export_program(module, spec, make_feeds(spec, example_sizes(spec), 0), opset=opset))
    _PROGRAMS.move_to_end(key)
    return _PROGRAMS[key]


def _program_key(spec: ModelSpec, opset: int) -> tuple[str, tuple[tuple[str, str], ...], int]:
    return spec.content_hash(), tuple(sorted(module_sources(spec).items())), opset


def _keep_program(spec: ModelSpec, opset: int, program: Any) -> None:
    """Keep ``program`` for the next case of the spec at ``opset`` (the last few models only)."""
    _PROGRAMS[_program_key(spec, opset)] = program
    while len(_PROGRAMS) > _KEPT_PROGRAMS:
        _PROGRAMS.popitem(last=False)


def _check_case(spec: ModelSpec, options: LocalizeOptions) -> dict[str, int]:
    """The case's sizes: the user's, else verify's distinct case as the graph is fed it
    (``fed_sizes``: a cache's ``extend_batch``)."""
    check_mask_case(spec, options.mask_case, spec.name)
    sizes = dict(options.sizes) if options.sizes else fed_sizes(spec, example_sizes(spec))
    validate_sizes(spec, sizes)
    return spec.with_sums(sizes)


def _decode_step(
    spec: ModelSpec, module: Any, options: LocalizeOptions, budget: int
) -> tuple[dict[str, int], dict[str, np.ndarray], str, Trajectory]:
    """The sizes and feeds of decode step ``options.decode_step`` (1 = the prompt) of a
    padding layout as verify --decode plays it, with the cache PyTorch's own steps fed back: the
    step is localized on PyTorch's inputs, so only its own divergence shows."""
    cache = cache_of(spec)
    if cache is None:
        raise OptionError(
            "{model}: {decode_step} needs a model with a key/value cache", ["decode_step"], model=spec.name
        )
    names = layouts(spec, cache)
    layout = options.layout or names[0]
    if layout not in names:
        has = ", ".join(names)
        raise OptionError(
            f"{{model}}: {{layout}} {{value}} does not apply (it has: {has})", ["layout"], model=spec.name, value=layout
        )
    step = options.decode_step or 0
    # verify draws every token of the trajectory at once: plan as many steps as it played
    traj = plan_trajectory(spec, cache, layout, max(options.decode_steps, step - 1), options.seed)
    if not 1 <= step <= len(traj.steps):
        steps = f"{{model}}: {{decode_step}} {{value}} is not a step of {layout} (1 to {len(traj.steps)})"
        raise OptionError(steps, ["decode_step"], model=spec.name, value=step)
    check_memory(spec, [ShapePoint("localize", s) for s in traj.sizes], budget)
    with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims) as eager:
        outputs, error = run_trajectory(eager, spec, traj)
    if error:
        raise UsageError(f"{spec.name}: decode {layout}: PyTorch failed at {error}")
    return traj.sizes[step - 1], step_inputs(spec, traj, outputs)[step - 1], layout, traj


def _in_buffers(
    proto: onnx.ModelProto, spec: ModelSpec, feeds: Mapping[str, np.ndarray]
) -> tuple[Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """For a graph updating its cache in place (``static-cache``), the feeds as it takes them
    (each past in a buffer of the spec's capacity, NaN past the filled length, and the
    filled length) and a cut of its presents to the filled positions, which PyTorch's
    growing cache holds; for any other graph, the feeds and no cut."""
    static = StaticCache.from_metadata({p.key: p.value for p in proto.metadata_props})
    if static is None:
        return dict, dict(feeds)
    capacity = capacity_for(spec.cache_max_seq, spec.dims, spec.outputs, static)

    def cut(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return static.filled((spec.inputs, spec.outputs, spec.dims), feeds, values)

    return cut, static.feeds(feeds, capacity)


def _regions(
    proto: onnx.ModelProto,
    regions: list[Region],
    torch_vals: TorchValues,
    graph_vals: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    tol: Tolerance,
    on: Target,
    budget: int,
    rows: np.ndarray | None,
    filled: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    timeout_s: float,
) -> tuple[list[RegionError], dict[str, tuple[dict[str, np.ndarray], Tolerance]]]:
    """Every region run alone (for at most ``timeout_s`` seconds), in graph order (judged in
    data order, ``_data_order``), on
    PyTorch's values where PyTorch has them (the graph's inputs and its shape arithmetic as
    the regions before computed them); each that holds an FX node's tensor is compared,
    beside the whole graph's value there. Also the inputs each region whose own error
    breaks the tolerance was fed, and the tolerance it was judged by (for a bundle)."""
    forced: dict[str, np.ndarray] = {}
    half = in_float16(tol)  # each region also run on its inputs nudged (``nudged``)
    # the graph's outputs are named for the spec's outputs, not for their FX nodes
    pytorch = {**torch_vals, **{k: torch_vals[v] for k, v in torch_vals.outputs.items() if v in torch_vals}}
    out: list[RegionError] = []
    places: list[int] = []  # each error's region's place in data order (``_data_order``)
    rank = _data_order(regions)
    fed: dict[str, tuple[dict[str, np.ndarray], Tolerance]] = {}
    for k, region in enumerate(regions):
        sources = (feeds, pytorch, forced)  # a graph input is itself, whatever an FX node is named
        if not all(any(i in src for src in sources) for i in region.inputs):
            continue  # fed by a region that could not run alone
        pytorch_in = {i: next(src[i] for src in sources if i in src) for i in region.inputs}
        teacher = {i: _as_graph(v, graph_vals.get(i)) for i, v in pytorch_in.items()}
        # inputs PyTorch's values overflow in the graph's dtype: what the region computes
        # from them clipped is no value PyTorch has, so its error is not its own
        clipped = [i for i, v in pytorch_in.items() if i in graph_vals and beyond(v, graph_vals[i].dtype)]
        ran = run_region(proto, region, teacher, on, budget, timeout_s)
        alone = filled(ran) if isinstance(ran, dict) else None
        nudge = half and alone and region.compared  # a region no value of which is compared is run once
        moved = run_region(proto, region, nudged(teacher), on, budget, timeout_s) if nudge else None
        forced.update(alone or {})
        for value, fx_node in region.compared:
            whole = graph_vals.get(value)
            computed = next((v.dtype for v in ((alone or {}).get(value), whole) if v is not None), None)
            expected = representable(torch_vals[fx_node], computed)
            ties = torch_vals.ties.get(fx_node, 0.0) + _moved_by(alone, moved, value)
            rtol = region_tolerance(tol, expected, computed, ties)
            target, source, code = torch_vals.sources.get(fx_node, ("", "", ""))
            own = fx_node == region.fx_node  # the region's metadata is its own FX node's
            # on a box without torch the graph's stack traces are read without telling torch's
            # frames apart (a Linear's line was torch's F.linear): a recorded line, read with torch, wins
            line = own and not (torch_vals.recorded and source)
            places.append(rank[k])
            out.append(
                RegionError(
                    fx_node=fx_node,
                    value=value,
                    nodes=list(region.nodes),
                    node=region.producers.get(value, ""),
                    ops=list(region.ops),
                    target=(own and region.target) or target,
                    module_path=region.module_path if own else "",
                    source=(line and region.source) or source,
                    code=(line and region.code) or code,
                    local=None
                    if alone is None
                    else _judged(fx_node, torch_vals[fx_node], expected, alone[value], rows, rtol),
                    propagated=None
                    if whole is None
                    else _judged(fx_node, torch_vals[fx_node], expected, whole, rows, rtol),
                    refused=ran if isinstance(ran, str) else None,
                    covers=list(region.covers) if len(region.covers) > 1 else [],
                    lines=_lines(region.covers, torch_vals) if len(region.covers) > 1 else [],
                    clipped=clipped,
                )
            )
            if out[-1].breaks:
                fed[value] = teacher, rtol
    return [e for _, e in sorted(zip(places, out, strict=True), key=lambda pair: pair[0])], fed


def _judged(
    fx_node: str, value: np.ndarray, expected: np.ndarray, actual: np.ndarray, rows: np.ndarray | None, tol: Tolerance
) -> OutputComparison:
    """The graph's ``actual`` against PyTorch's ``value`` of ``fx_node`` as the graph can hold
    it (``expected``: clipped to its dtype's range), an overflow beyond that range held as
    its end, the padded rows left out."""
    return judge_value(fx_node, expected, left_out(expected, held(value, actual), rows), tol)


def _moved_by(alone: Mapping[str, np.ndarray] | None, moved: object, value: str) -> float:
    """How far ``value`` moved where the region's inputs were nudged (0 where it was not run so)."""
    if alone is None or not isinstance(moved, dict) or value not in moved or value not in alone:
        return 0.0
    a, b = np.asarray(alone[value]), np.asarray(moved[value])
    if a.dtype.kind != "f" or a.shape != b.shape:
        return 0.0
    both = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[both].astype(np.float64) - b[both]).max(initial=0.0))


def _data_order(regions: list[Region]) -> list[int]:
    """Each region's place when every region comes after those feeding it, graph order among
    the rest: a fused region's first node may run before a projection it reads (its length
    arithmetic reads the graph's inputs), and the first region to break its tolerance, the
    one blamed, was a packed cache's attention fed a faulty key's padded rows, not the key's
    projection. Regions feeding each other both ways are placed together, in graph order."""
    made = {v: k for k, r in enumerate(regions) for v in r.producers}
    feeds = [sorted({made[i] for i in r.inputs if i in made} - {k}) for k, r in enumerate(regions)]
    group = _strongly_connected(feeds)
    members: dict[int, list[int]] = {}
    for k, g in enumerate(group):
        members.setdefault(g, []).append(k)
    fed_by = {g: {group[j] for k in ks for j in feeds[k]} - {g} for g, ks in members.items()}
    readers: dict[int, list[int]] = {}
    for g, sources in fed_by.items():
        for h in sources:
            readers.setdefault(h, []).append(g)
    waiting = {g: len(sources) for g, sources in fed_by.items()}
    ready = [(members[g][0], g) for g in members if not waiting[g]]
    heapq.heapify(ready)
    rank = [0] * len(regions)
    placed = 0
    while ready:
        _, g = heapq.heappop(ready)
        for k in members[g]:
            rank[k], placed = placed, placed + 1
        for h in readers.get(g, []):
            waiting[h] -= 1
            if not waiting[h]:
                heapq.heappush(ready, (members[h][0], h))
    return rank


def _strongly_connected(reads: list[list[int]]) -> list[int]:
    """Each node's strongly connected set (Tarjan's, without recursion) in the graph where
    node ``k`` reads the nodes ``reads[k]``."""
    count = len(reads)
    index, low, group = [-1] * count, [0] * count, [-1] * count
    stack: list[int] = []
    seen = groups = 0
    for root in range(count):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = seen
                seen += 1
                stack.append(v)
            else:  # back from the child read at i - 1
                low[v] = min(low[v], low[reads[v][i - 1]])
            for j in range(i, len(reads[v])):
                w = reads[v][j]
                if index[w] < 0:
                    work += [(v, j + 1), (w, 0)]
                    break
                if group[w] < 0:  # on the stack
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    while True:
                        w = stack.pop()
                        group[w] = groups
                        if w == v:
                            break
                    groups += 1
    return group


def _as_graph(value: np.ndarray, graph: np.ndarray | None) -> np.ndarray:
    """PyTorch's ``value`` in the float dtype the graph computes it in (float16 inside an
    fp16 variant): a region fed float32 where it reads float16 will not load, and was blamed."""
    if graph is not None and value.dtype != graph.dtype and value.dtype.kind == graph.dtype.kind == "f":
        return representable(value, graph.dtype).astype(graph.dtype)
    return value


def _lines(fx_nodes: Sequence[str], torch_vals: TorchValues) -> list[str]:
    """The distinct ``file:line`` of ``fx_nodes``, in their order."""
    return list(dict.fromkeys(torch_vals.sources[f][1] for f in fx_nodes if torch_vals.sources.get(f, ("", ""))[1]))


def _blame(errors: list[RegionError], torch_vals: TorchValues, accumulates: bool) -> tuple[RegionError | None, str]:
    """The region to blame for a case that fails, and why (``LocalizeReport.cause``): the
    first whose own error breaks the tolerance; else, where PyTorch's outputs hold NaN or
    Inf, where it first gives one (the graph does as the module does; a masked score at
    -inf is no cause where the outputs are finite); else, where an error that ``accumulates``
    past the tolerance is the graph's, the first value outside it. An int4 graph judged
    within int4's own room of the float module accumulates its rounding, not a fault: its
    first such value was a node before the fault, in a right graph too."""
    first = next((r for r in errors if r.breaks), None)
    if first is not None:
        return first, "graph"
    refused = next((r for r in errors if r.refused), None)
    if refused is not None:
        return refused, "refused"

    def finite(fx_node: str) -> bool:
        return torch_vals[fx_node].dtype.kind != "f" or bool(np.isfinite(torch_vals[fx_node]).all())

    outputs = [fx for fx in torch_vals.outputs.values() if fx in torch_vals]
    nonfinite = next((r for r in errors if not finite(r.fx_node)), None) if not all(map(finite, outputs)) else None
    if nonfinite is not None:
        return nonfinite, "module"
    if not accumulates:
        return None, "accumulated"
    return next((r for r in errors if r.propagated and not r.propagated.passed), None), "accumulated"


def _reproduce(out_dir: Path, entry: ManifestEntry, options: LocalizeOptions, sizes: Mapping[str, int]) -> str:
    if options.spec_file is not None:  # a graph no build made: the file and its spec
        where = [str(out_dir / entry.file), "--spec", str(options.spec_file)]
        where += ["--variant", options.variant] if options.variant != "fp32" else []
    else:
        where = [str(out_dir), entry.name]
    if options.golden:
        args = [*where, "--golden", *(["--from", str(options.golden_from)] if options.golden_from else [])]
    elif options.generate_step is not None:
        args = [*where, "--generate-step", str(options.generate_step), "--generate", str(options.generate_steps)]
        args += ["--layout", options.layout] if options.layout else []
        args += ["--seed", str(options.seed)]
    elif options.decode_step is None:
        args = [*where, "--shapes", format_sizes(sizes), "--seed", str(options.seed)]
        args += ["--distribution", options.distribution]
    else:
        args = [*where, "--decode-step", str(options.decode_step), "--seed", str(options.seed)]
        args += ["--layout", options.layout] if options.layout else []
        args += ["--decode-steps", str(options.decode_steps)] if options.decode_steps != DEFAULT_STEPS else []
    args += ["--mask-case", options.mask_case] if options.mask_case else []
    # the default folder goes without saying, but in golden mode a folder named at all turns the stale check on
    named = options.golden_checkout if options.golden else str(options.models_dir) != "models"
    models = named and options.spec_file is None
    args += ["--models", str(options.models_dir)] if models else []
    args += ["--runtime", options.runtime] if options.runtime != DEFAULT_RUNTIME else []
    args += ["--provider", options.provider] if options.target.provider not in (None, "cpu") else []
    args += ["--fully-masked", options.fully_masked] if options.fully_masked else []
    args += ["--timeout", f"{options.timeout_s:g}"] if options.timeout_s != RUN_TIMEOUT_S else []
    return "attn-export localize " + " ".join(shlex.quote(a) for a in args)


def _maps_through_plain(variant: str) -> bool:
    """Whether ``variant``'s graph is made from the plain export (for a chain, its first
    link), so its fused regions are mapped back through it; a re-export at another opset
    (``attention-op``, ``ort-past``) carries the FX metadata on its own nodes."""
    return variant != "fp32" and not variant_chain(variant).export_opset


def _plain_graph(out_dir: Path, manifest: Manifest, entry: ManifestEntry, budget: int) -> onnx.ModelProto | None:
    """For a variant made from the plain export, the folder's plain graph of the same spec:
    what its fused regions are mapped back to."""
    plain = plain_export(out_dir, manifest, entry)
    if plain is None or not _maps_through_plain(entry.variant):
        return None
    return load_model_file(out_dir / plain.file, with_data=True, budget=budget)


def _exported_plain(spec: ModelSpec) -> onnx.ModelProto:
    """The spec's plain graph as build exports it (module, export, graph checks), for a
    graph no build made: no plain graph lies beside it to map its fused regions back to.
    Build's stages write nothing here; their folder is a temporary one all the same."""
    # imported here: build records localize's values, so its package imports this one's
    from attn_export.pipelines.building.graphs import SpecBuild
    from attn_export.pipelines.building.results import BuildOptions

    with tempfile.TemporaryDirectory() as folder:
        build = SpecBuild(spec, versions(), BuildOptions(Path(folder)))
        plain = build.export(spec.opset)  # checked as build checks it; its nodes' FX metadata is the map
    if spec.opset in build.programs:  # the same export localize runs the module's side on: not made twice
        _keep_program(spec, spec.opset, build.programs[spec.opset])
    return plain


def localize_model(out_dir: Path, model: str | None, options: LocalizeOptions) -> LocalizeReport:
    """Localize one case of one built graph (``model`` may be left out when the folder holds
    one); with ``options.spec_file``, ``out_dir`` is one .onnx file no build made
    (``verify --spec``). UsageError/ArtifactError on bad input; the verdict is data. A run
    of the whole graph past ``options.timeout_s`` is a note (its regions still run), one of
    a region RunTimeout naming it."""
    options.check()
    if options.runtime not in RUNTIMES:
        raise UsageError(f"unknown runtime {options.runtime} (known: {', '.join(RUNTIMES)})")
    if options.target.provider is not None:
        require_provider(options.target.provider)
    if options.spec_file is None:
        found = _built(out_dir, model, options)
    elif options.golden_from is not None:
        found = _edited(out_dir, model, options)
    else:
        found = _outside(out_dir, model, options)
    if options.bundle is not None:
        check_bundle_folder(options.bundle)
    report, replay = _localize(found, options)
    if options.shrink and not report.agrees:
        asked = report.sizes
        smallest, _, tries = shrink_case(found.spec, options, report, lambda trial: _localize(found, trial)[0])
        report, replay = _localize(found, smallest)  # its bundle too
        report.shrunk_from, report.shrink_tries = asked, tries
    if options.bundle is not None and replay is None:
        why = "the case agrees" if report.agrees else "no single region's own error is to blame"
        report.notes.append(f"no replay bundle written: {why}")
    if options.bundle is not None and replay is not None:
        first = replay.region
        info = {
            "model": found.entry.name,
            "fx_node": first.fx_node,
            "nodes": first.nodes,
            "value": first.value,
            "source": first.source,
            "code": first.code,
            "tolerance": {k: getattr(replay.tolerance, k) for k in TOLERANCE_KEYS},
            "left_out_rows": None if replay.rows is None else replay.rows.astype(bool).tolist(),
            "localize": report.reproduce,
        }
        write_bundle(options.bundle, replay.model, replay.inputs, replay.expected, info)
        report.bundle = str(options.bundle)
    return report


@dataclass
class _Found:
    """The graph a case is localized on, with what it is judged by."""

    out_dir: Path
    entry: ManifestEntry
    spec: ModelSpec
    proto: onnx.ModelProto
    #: For a variant, the plain export its fused regions are mapped back to (the one beside
    #: it, or for a graph no build made, exported from the spec).
    plain: onnx.ModelProto | None
    #: Said in the report of every case localized on it (where ``plain`` came from).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: In golden mode, the recorded intermediates it is judged by (default: its entry's, beside it).
    recorded: Path | None = None


def _built(out_dir: Path, model: str | None, options: LocalizeOptions) -> _Found:
    """A built graph of the folder, its files intact and its build current."""
    with read_lock(out_dir, options.lock_wait_s):
        manifest = load_manifest(out_dir)
        if model is None:
            if len(manifest.models) != 1:
                names = ", ".join(sorted(manifest.models))
                raise UsageError(f"{out_dir} holds {len(manifest.models)} models; name one: {names}")
            model = next(iter(manifest.models))
        if model not in manifest.models:
            raise UsageError(f"{out_dir}: no model '{model}' (it has: {', '.join(sorted(manifest.models))})")
        entry = manifest.models[model]
        if options.golden and not entry.intermediates:
            raise UsageError(_unrecorded(model, out_dir))
        problems = integrity(out_dir, entry, *(("intermediates",) if options.golden else ()))
        if problems:
            raise ArtifactError(problems[0])
        # a golden run's spec is the recorded one (data: no code runs)
        spec = entry.model_spec if options.golden else checkout_spec(options.models_dir, entry)
        stale = stale_against_checkout(options.models_dir, entry, spec, options.golden, options.golden_checkout)
        if stale:
            raise UsageError(f"{model}: stale build: {'; '.join(stale)}; run attn-export build first")
        budget = memory_budget(options.max_memory, spec)
        proto = load_model_file(out_dir / entry.file, with_data=True, budget=budget)
        plain = _plain_graph(out_dir, manifest, entry, budget)
    if plain is not None or options.golden:  # a recording is all a golden run has of the module
        return _Found(out_dir, entry, spec, proto, plain)
    # the export runs after the lock: a build waiting on the folder need not wait for it
    return _mapped_from_spec(out_dir, entry, spec, proto, f"{spec.name}'s spec", "in this build folder")


def _outside(graph: Path, model: str | None, options: LocalizeOptions) -> _Found:
    """A graph no build made, as ``outside_manifest`` lists it, with its spec; for a variant
    made from the plain export, that export made again from the spec, as none lies beside it."""
    assert options.spec_file is not None
    out_dir, manifest, (name,) = outside_manifest(graph, options.spec_file, options.variant)
    if model not in (None, name):
        other = f"{{graph}}: {{spec_file}} {{value}} makes it model '{name}', not '{model}'"
        raise OptionError(other, ["spec_file"], graph=graph, value=options.spec_file)
    entry = manifest.models[name]
    spec = outside_spec(options.spec_file, entry)
    proto = load_model_file(graph, with_data=True, budget=memory_budget(options.max_memory, spec))
    return _mapped_from_spec(out_dir, entry, spec, proto, f"the spec {options.spec_file}", "beside this one")


def _edited(graph: Path, model: str | None, options: LocalizeOptions) -> _Found:
    """A graph no build made (a copy of a built graph, edited by hand), to be localized on
    the intermediates recorded for the build's graph of its spec and variant in the build
    folder ``options.golden_from``: paired with them by the FX nodes its values are named
    for, as with PyTorch's. The spec file names the graph and must be the one the build
    recorded; the build's spec is read as data, so no torch and no module code run. The
    build folder is read only (its graph need not be the one given, its recording must be
    intact)."""
    assert options.spec_file is not None and options.golden_from is not None
    check_graph_file(graph, options.variant)
    build, spec_file = options.golden_from, options.spec_file
    wanted = load_spec(spec_file)  # data only: no module is imported
    name = variant_key(wanted.name, options.variant)
    if model not in (None, name):
        other = f"{{graph}}: {{spec_file}} {{value}} makes it model '{name}', not '{model}'"
        raise OptionError(other, ["spec_file"], graph=graph, value=spec_file)
    with read_lock(build, options.lock_wait_s):
        manifest = load_manifest(build)
        if name not in manifest.models:
            has = ", ".join(sorted(manifest.models))
            asked = f"{build}: no model '{name}' ({spec_file} as {options.variant}) to pair the graph with"
            raise UsageError(f"{asked}; it has: {has}")
        entry = manifest.models[name]
        if not entry.intermediates:
            raise UsageError(_unrecorded(name, build))
        problems = integrity(build, entry, "intermediates", graph=False)
        if problems:
            raise ArtifactError(problems[0])
        stale = stale_reasons(entry, dataclasses.replace(wanted, guards=entry.model_spec.guards))
        if stale:
            raise UsageError(
                f"{name}: {build} recorded it from another spec ({'; '.join(stale)}): its values are not those of "
                f"{spec_file}'s module; build it again with --record-intermediates"
            )
        spec = entry.model_spec  # data: the recording is the module's side, no code runs
        budget = memory_budget(options.max_memory, spec)
        proto = load_model_file(graph, with_data=True, budget=budget)
        plain = _plain_graph(build, manifest, entry, budget)
    check_described(proto, graph, spec, spec_file)  # no recorded value could feed it otherwise
    copy = dataclasses.replace(entry, file=graph.name, sha256="")  # not the build's graph: no hash to claim
    return _Found(graph.parent, copy, spec, proto, plain, recorded=build / entry.intermediates)


def _mapped_from_spec(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, proto: onnx.ModelProto, source: str, where: str
) -> _Found:
    """``proto`` with, for a variant made from the plain export that has no plain graph
    ``where`` it lies, that export made again from the spec (``source``) as the map of its
    fused regions, and a note saying so; without one, a fused region is one lump."""
    if spec.exporter != "dynamo" or not _maps_through_plain(entry.variant):  # the former is refused below
        return _Found(out_dir, entry, spec, proto, None)
    said = (
        f"{entry.variant}'s fused regions are mapped back to FX nodes through the plain graph exported "
        f"now from {source} (no build's plain graph lies {where})"
    )
    return _Found(out_dir, entry, spec, proto, _exported_plain(spec), [said])


@dataclass
class _Replay:
    """What a bundle of the blamed region holds: its graph, its inputs and PyTorch's value."""

    #: The region: the one blamed, or where the outputs agree, the first over its tolerance.
    region: RegionError
    model: bytes
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    tolerance: Tolerance
    #: The padded query rows ``[batch, query]`` left out of the judgement, if any.
    rows: np.ndarray | None


@dataclass
class _Side:
    """PyTorch's side of one case: its sizes and feeds, the value of every FX node, and the
    outputs as verify judges them (with PyTorch's own float32 error)."""

    sizes: dict[str, int]
    feeds: dict[str, np.ndarray]
    values: TorchValues
    case: GoldenCase
    #: At a decoder's step: where the module with its cache parts from its own one pass.
    module_bug: RegionError | None = None


def _pytorch_side(
    spec: ModelSpec, proto: onnx.ModelProto, options: LocalizeOptions, budget: int, variant: str, int4: int
) -> tuple[_Side, LocalizeOptions]:
    """Run the module's FX program and the module itself on the case ``options`` name. Where
    the graph has ``int4`` MatMulNBits (more than 0) and the program as the int4 variant's
    simulation computes it (``simulated_values``) rounds as many matmuls, its values are
    those (``TorchValues.int4_rounded``); a decode step's stay the float module's, which its
    one pass is compared with."""
    module = instantiate(spec)
    activations = int4_compute(proto) != "float"  # a CPU computing MatMulNBits in float rounds the weights alone
    if options.generate_step is not None:
        padding = padding_side(spec, variant, lambda: proto)
        generating = generation_rounding(spec, variant)
        sizes, feeds, layout = generate_step_case(spec, module, options, generating, padding, activations)
        options = dataclasses.replace(options, layout=layout)
    elif options.decode_step is None:
        sizes = _check_case(spec, options)
        check_memory(spec, [ShapePoint("localize", sizes)], budget)
        feeds = make_feeds(
            spec, sizes, options.seed, case=options.mask_case or PATTERN, distribution=options.distribution
        )
    else:
        sizes, feeds, layout, traj = _decode_step(spec, module, options, budget)
        options = dataclasses.replace(options, layout=layout)
    program = _program(spec, module, default_opset(proto) or 0)
    simulated = int4 and options.decode_step is None
    values = simulated_values(program, spec, feeds, budget, int4, activations) if simulated else None
    values = values or torch_values(program, spec, feeds, budget)
    # the simulated rounding of the variant's quantization (int8, int4), which its tolerances judge by
    bits = rounding_bits(spec.tolerances(variant).values())
    with TorchRuntime(
        module, spec.inputs, spec.outputs, spec.dims, rounding_bits=bits, int4_activations=activations
    ) as eager:
        outputs = eager.run(feeds)
        seen = sights(spec, eager, example_sizes(spec), [sizes])
        floors, int8 = eager.allowances(feeds, outputs)
        case = GoldenCase("localize", dict(sizes), feeds, outputs, floors, int8, seen)
    side = _Side(dict(sizes), feeds, values, case)
    if options.decode_step is not None:
        side.module_bug = parting_node(program, spec, traj, options.decode_step, values, budget, spec.tolerance)
    return side, options


def _unsimulated(options: LocalizeOptions, quantized: int, rounded: int) -> str:
    """Why an int4 graph's regions on a CPU are judged within int4's own room of the float
    module, not against its simulation (a fault smaller than int4's rounding passes there)."""
    if options.decode_step is not None:
        why = "a decode step's values are compared with the float module's one pass"
    elif options.golden and not rounded:
        why = (
            "the recorded intermediates are the float module's (an older attn-export recorded them, or the "
            "simulation rounded another count of matmuls than the graph's)"
        )
    else:
        why = (
            f"the {'recorded ' if options.golden else ''}simulation rounds another count of matmuls than the "
            f"{quantized} projections of the graph's MatMulNBits (a weight the module computes, code under a "
            "function of its own, or a graph edited after the build)"
        )
    return f"regions judged within int4's own room of the float module, not against int4's simulation: {why}"


def _unrecorded(model: str, build: Path) -> str:
    """Why ``localize --golden`` has nothing to pair ``model``'s graph with: a build records
    intermediates only when asked, and only of a graph whose nodes name their FX node."""
    return (
        f"{model}: no recorded intermediates in {build}; build it with --record-intermediates where torch is "
        "installed (it records none for a graph whose nodes carry no FX node metadata, ort-optimized's, and "
        "says so in a warning)"
    )


def _recorded_side(path: Path, spec: ModelSpec, budget: int) -> _Side:
    """The case ``build --record-intermediates`` recorded, read without torch."""
    rec = read_intermediates(path, spec, budget, root=path.parent)
    return _Side(rec.case.sizes, rec.case.inputs, TorchValues.from_recorded(rec), rec.case)


def _localize(found: _Found, options: LocalizeOptions) -> tuple[LocalizeReport, _Replay | None]:
    out_dir, entry, spec, plain = found.out_dir, found.entry, found.spec, found.plain
    model = entry.name
    try:
        proto = unpacked(found.proto)  # each packed projection judged as its own, as PyTorch has it
    except ArtifactError as e:
        raise NotLocalizable(f"{model}: {e}") from e
    started = time.perf_counter()
    if spec.exporter != "dynamo" or not (has_fx_metadata(proto) or (plain is not None and has_fx_metadata(plain))):
        raise NotLocalizable(
            f"{model}: localize needs a graph from the dynamo exporter, whose nodes name the FX node and "
            "source line they came from (this one has no such metadata)"
        )
    budget = memory_budget(options.max_memory, spec)
    if options.fully_masked is not None:
        spec = dataclasses.replace(spec, fully_masked=options.fully_masked)
    # int4 on a CPU, where its graph rounds as the simulation: its regions are judged against
    # the simulated module, as its outputs are, not within int4's own room of the float one
    on_a_cpu_int4 = simulated_on(options.target, found.proto)
    # a build records int4 as accuracy level 4 computes it, not as a graph computing in float
    recorded_other = options.golden and on_a_cpu_int4 and int4_compute(found.proto) == "float"
    on_a_cpu_int4 = on_a_cpu_int4 and not recorded_other
    exact = spec.simulated_tolerance("", entry.variant) if on_a_cpu_int4 else None
    quantized = quantized_projections(found.proto) if exact is not None else 0
    if options.golden:
        side = _recorded_side(found.recorded or out_dir / entry.intermediates, spec, budget)
    else:
        side, options = _pytorch_side(spec, proto, options, budget, entry.variant, quantized)
    sizes, feeds, torch_vals, case = side.sizes, side.feeds, side.values, side.case
    # before the graph runs: a graph that cannot be paired is refused without a whole run
    regions = graph_regions(proto, torch_vals.outputs, torch_vals.keys(), plain)
    why = unpaired(proto, regions, torch_vals.outputs, torch_vals.keys(), plain)
    if why is not None:
        theirs = "the recorded intermediates" if options.golden else "PyTorch's values"
        raise NotLocalizable(f"{model}: {entry.file} cannot be paired with {theirs}: {why}")
    outputs = case.outputs
    notes = list(found.notes)
    if recorded_other:
        notes.append(
            "regions and outputs judged within int4's own room of the float module, not against int4's simulation: "
            "the recorded intermediates round the activations as accuracy level 4 does, and this graph computes "
            "its MatMulNBits in float (level 0 or 1)"
        )
    filled, feeds = _in_buffers(proto, spec, feeds)
    try:
        graph_vals = filled(graph_values(proto, feeds, options.target, budget, options.timeout_s))
    except RuntimeFailure as e:
        graph_vals = {}
        notes.append(f"the whole graph fails to run: {e}")
    outputs_there = {k: graph_vals[k] for k in outputs if k in graph_vals}
    tolerances = spec.tolerances(entry.variant)
    if on_a_cpu_int4:  # against its simulation, as verify judges it
        tolerances = on_a_cpu(tolerances, spec.simulated_tolerances(entry.variant))
    judged, judge_notes = judge(spec, case, outputs_there, tolerances)
    notes += judge_notes
    tol = spec.tolerance_for("", entry.variant)  # a variant's own (int8, fp16), else the spec's
    if exact is not None and quantized == torch_vals.int4_rounded > 0:
        tol = exact
    elif exact is not None:
        notes.append(_unsimulated(options, quantized, torch_vals.int4_rounded))
    # Rows that see no key are left out of every region where the spec leaves them out of
    # the outputs, or where the graph's outputs agree there: a fused attention gives the mean
    # of V (or NaN) in them where PyTorch's sdpa gives 0, and a module that zeroes them after
    # it has a right graph whose attention differs there, which was blamed for a fault after it.
    agree = spec.fully_masked == "ignore" or padded_rows_agree(spec, case, outputs_there, tolerances)
    rows = padded_tokens(spec, case) if agree else None
    try:
        errors, fed = _regions(
            proto, regions, torch_vals, graph_vals, feeds, tol, options.target, budget, rows, filled, options.timeout_s
        )
    except RunTimeout as e:
        raise RunTimeout(f"{model}: {e}") from e
    unjudged = list(dict.fromkeys(e.fx_node for e in errors if e.clipped and e.local and not e.local.passed))
    if unjudged:
        notes.append(
            f"not judged: {', '.join(unjudged)}, fed PyTorch's values beyond the graph's float range "
            "(clipped, so their error is not their own)"
        )
    report = LocalizeReport(
        model=model,
        file=str(out_dir / entry.file),
        sizes=dict(sizes),
        golden_case=case.label if options.golden else None,
        seed=options.seed,
        distribution=options.distribution,
        mask_case=options.mask_case,
        provider=options.provider,
        runtime=options.runtime,
        outputs=judged,
        regions=errors,
        uncompared=len(regions) - len({tuple(e.nodes) for e in errors}),
        decode_step=options.decode_step,
        generate_step=options.generate_step,
        layout=options.layout,
        notes=notes,
        reproduce=_reproduce(out_dir, entry, options, sizes),
        module_bug=side.module_bug,
    )
    replay = None
    if not report.graph_agrees:
        report.first, report.cause = _blame(errors, torch_vals, accumulates=tol.weight_bits != 4)
        if report.first is None and report.cause == "accumulated" and tol.weight_bits == 4 and exact is None:
            report.notes.append(
                "regions judged within int4's own room of the float module (int4 not computed as its simulation "
                "rounds here, or the spec names its room): its rounding accumulates, so no value past the "
                "tolerance is blamed"
            )
    first = report.first if report.cause == "graph" else report.hidden_region
    if first is not None:
        region = next(r for r in regions if (first.value, first.fx_node) in r.compared)
        teacher, region_tol = fed[first.value]
        replay = _Replay(
            first,
            region_model(proto, region, teacher).SerializeToString(),
            teacher,
            {first.value: torch_vals[first.fx_node]},
            region_tol,
            rows,
        )
    report.seconds = time.perf_counter() - started
    return report, replay


def _step_options(base: LocalizeOptions, seed: int, target: Target, **step: Any) -> LocalizeOptions:
    """``base`` at one decode or generate ``step`` verify ran on ``target`` with ``seed``."""
    return dataclasses.replace(base, seed=seed, provider=target.provider or "cpu", runtime=target.runtime, **step)


def localize_failures(
    report: VerifyReport,
    options: VerifyOptions,
    notice: Callable[[str], None] | None = None,
) -> list[LocalizeReport]:
    """``verify --localize``: the first failing case of each model that verify compared with
    PyTorch on ONNX Runtime, else the first step where a decode trajectory left PyTorch's, else
    the first step where our loop's generation did, localized (one case per model bounds the
    cost: the others usually fail at the same node). A graph localize cannot take
    (``NotLocalizable``: no dynamo exporter's metadata), or whose region runs past
    ``options.region_timeout_s`` seconds (``RunTimeout``), is said to ``notice`` and left out, where one is
    given: verify's verdict and reports stand."""
    out_dir, base = _base_options(report, options)
    asked: dict[str, LocalizeOptions] = {}
    for case in report.failed_cases:
        if _numeric(case) and case.model not in asked:
            asked[case.model] = _case_options(base, case)
    for d in report.decode:
        step = d.first_divergence or d.module_bug
        if step is not None and d.model not in asked:
            asked[d.model] = _step_options(
                base, report.seed, d.target, decode_step=step.step, layout=d.scenario, decode_steps=options.steps
            )
    ours = {t.label: t for t in options.targets}  # genai's generator runs the graph its own way
    for g in report.generate:
        target = ours.get(g.runner)
        if target is not None and g.step is not None and g.model not in asked:
            asked[g.model] = _step_options(
                base, report.seed, target, generate_step=g.step, generate_steps=g.steps, layout=g.layout
            )
    found = []
    for model, opts in asked.items():
        try:
            found.append(localize_model(out_dir, model, opts))
        except (NotLocalizable, RunTimeout) as e:
            if notice is None:
                raise
            notice(f"{model} not localized: {e}")
    return found


def _base_options(report: VerifyReport, options: VerifyOptions) -> tuple[Path, LocalizeOptions]:
    """Where verify's graphs are (for ``verify --spec``, the one graph it was given, not a
    build folder) and the localize options every case of them shares."""
    out_dir = Path(report.artifacts)
    base = LocalizeOptions(
        models_dir=options.models_dir,
        max_memory=options.max_memory,
        lock_wait_s=options.lock_wait_s,
        spec_file=options.spec_file,
        variant=options.variant,
        timeout_s=options.region_timeout_s,
    )
    if options.spec_file is not None:
        out_dir = out_dir / report.checks[0].file
    return out_dir, base


def _numeric(case: CaseResult) -> bool:
    """Whether verify compared ``case`` with PyTorch on inputs localize can make again."""
    return case.expected_from.startswith("torch") and case.distribution != RECORDED and bool(case.comparisons)


def _case_options(base: LocalizeOptions, case: CaseResult) -> LocalizeOptions:
    """``base`` localizing verify's ``case``: its sizes, seed, values, mask case and target."""
    return dataclasses.replace(
        base,
        sizes=case.sizes,
        seed=case.seed,
        distribution=case.distribution,
        mask_case=case.shape if case.shape in CASES else None,
        provider=case.target.provider or "cpu",
        runtime=case.target.runtime,
    )


def check_regions(
    report: VerifyReport,
    options: VerifyOptions,
    notice: Callable[[str], None] | None = None,
) -> None:
    """Verify's ``options.regions`` (``check`` or ``strict``), run by ``verify_artifacts``:
    each model whose graph passed has one case verify compared with
    PyTorch localized, and where a region's own error breaks its tolerance though the
    outputs agree, its model's checks get a note naming the region and its source line (the
    graph still passes), or under ``strict`` a problem saying the same (the graph fails).
    The case is verify's distinct case (the build's example sizes) where it ran one, else
    its first. A graph localize cannot take is said to ``notice`` and left as verify judged
    it (a check that cannot run fails nothing), where one is given. A region that runs past
    ``options.region_timeout_s`` seconds fails its model's checks either way, the region and
    the limit named: a graph that does not end on PyTorch's values does not pass."""
    out_dir, base = _base_options(report, options)
    strict = options.regions == "strict"
    failed = set(report.failed_models)
    firsts: dict[str, CaseResult] = {}
    for case in report.cases:  # the distinct case where verify ran it: every size its own
        if case.model in failed or not _numeric(case):
            continue
        if case.model not in firsts or (case.shape == "distinct" and firsts[case.model].shape != "distinct"):
            firsts[case.model] = case
    for check in report.checks:
        if check.model not in firsts:
            continue
        case = firsts[check.model]
        try:
            found = localize_model(out_dir, check.model, _case_options(base, case))
        except NotLocalizable as e:
            if notice is None:
                raise
            notice(f"{check.model} not region-checked: {e}")
            continue
        except RunTimeout as e:  # a failure of its own, printed with the failures
            check.problems.append(str(e))
            continue
        region = found.hidden_region
        if region is None:
            continue
        said = (
            f"{check.model}: outputs agree, but region {region.fx_node} ({region.source or 'no source line'}) "
            f"breaks its tolerance on {case.runtime} at {format_sizes(case.sizes)} "
            f"({case.distribution}, seed {case.seed}): "
            f"{region.local.reason() if region.local else 'not computed'}; where: {found.reproduce}"
            + (" --strict-regions" if strict else "")
        )
        (check.notes if found.passed(strict_regions=strict) else check.problems).append(said)
