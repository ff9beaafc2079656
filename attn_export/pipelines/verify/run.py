"""The verify pipeline: manifest -> integrity and graph checks -> cells (each model x target
x case: expected outputs from PyTorch or golden vectors, the target's run, comparison) on an
executor -> timing, one case at a time -> a VerifyReport.

Verify measures and collects; ``compare.latency`` judges, and ``report/`` renders.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_export.artifacts.files import read_lock, resolved
from attn_export.artifacts.golden import GoldenCase
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.recorded import read_recorded
from attn_export.checks.decode.results import DecodeResult
from attn_export.checks.generate import generate_prompts, is_causal_lm
from attn_export.errors import ArtifactError, AttnExportError, OptionError, RuntimeFailure, UsageError
from attn_export.executors import SERIAL, Parallelism, open_executor
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import cache_of
from attn_export.model_spec.memory import memory_budget
from attn_export.model_spec.scenarios import scenario_sizes
from attn_export.model_spec.shapes import check_mask_case, validate_sizes
from attn_export.pipelines.verify.cells import (
    CaseCell,
    DecodeCell,
    ModelWork,
    Record,
    TargetRun,
    TargetWork,
    check_cases,
    decode_cell,
    placement_cell,
    placement_key,
    read_model_golden,
    release,
    set_latency,
    time_case,
)
from attn_export.pipelines.verify.expected import case_plan, golden_expected
from attn_export.pipelines.verify.greedy_generations import generate_model, recorded_reference
from attn_export.pipelines.verify.models import (
    checkout_spec,
    graph_problems,
    integrity,
    plain_export,
    stale_against_checkout,
)
from attn_export.pipelines.verify.outside import changed_since, outside_spec
from attn_export.pipelines.verify.placement import gate_cases
from attn_export.pipelines.verify.results import (
    CaseResult,
    ModelCheck,
    PlacementResult,
    VerifyOptions,
    VerifyReport,
    runtime_versions,
)
from attn_export.runtimes import RUNTIMES, Target
from attn_export.runtimes.timing import check_threads, physical_cores

__all__ = ["verify_artifacts", "verify_module"]


def verify_artifacts(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    parallelism: Parallelism = SERIAL,
    run: Sequence[str] | None = None,
) -> VerifyReport:
    """Verify each named model (``run``: every model of the run ``names`` are a shard of,
    which a check of the whole run, as ``--generate``'s for a causal LM among them, asks);
    problems become failed checks or cases, never exceptions, except bad usage (unknown
    provider, shapes outside the declared ranges, no spec in the checkout for a model
    verified against PyTorch). Cells run on the executor ``parallelism``
    names (by default one after another, in this process): the report is the same whichever
    runs them. The folder is read under a shared lock: a build in progress is waited for
    (``on_notice`` hears it once), and ``manifest`` is read again once it is done. With
    ``options.spec_file``, the manifest is ``outside_manifest``'s of a graph no build made
    (``_verify_outside``). With ``options.regions``, each graph that passed then has its
    regions checked (``localize.check_regions``), after the lock: a graph localize cannot
    take is said to ``on_notice`` and left as judged, or without one raised (NotLocalizable)."""
    if options.spec_file is not None:
        report = _verify_outside(out_dir, manifest, names, options, on_model, on_notice, parallelism)
    else:
        with read_lock(out_dir, options.lock_wait_s, on_notice):
            if (out_dir / MANIFEST_NAME).is_file():
                manifest = load_manifest(out_dir)
            missing = [n for n in names if n not in manifest.models]
            if missing:
                raise ArtifactError(f"{out_dir}: the manifest no longer lists {', '.join(missing)}")
            if not options.golden and resolved(options.models_dir).is_relative_to(resolved(out_dir)):
                inside = "{models_dir} {value} is inside the build folder {folder}: verify runs code only from the "
                inside += "checkout, never from a build folder; pass {models_dir} with the checkout's spec folder"
                raise OptionError(inside, ["models_dir"], value=options.models_dir, folder=out_dir)
            report = _verify_locked(out_dir, manifest, names, options, on_model, parallelism, run)
    if options.regions is not None:
        from attn_export.pipelines.localize.run import check_regions  # torch's side, only when asked

        check_regions(report, options, on_notice)
    return report


def _verify_outside(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None,
    on_notice: Callable[[str], None] | None,
    parallelism: Parallelism,
) -> VerifyReport:
    """A graph no build made (edited by hand, or exported by a script of the user's), listed
    by ``outside.outside_manifest`` in a manifest of its own that is never read from the
    folder, judged against ``options.spec_file``. Golden mode needs a build's golden file
    and is refused. A build in progress in the folder is waited for."""
    assert options.spec_file is not None
    options = dataclasses.replace(options, models_dir=options.spec_file.parent)

    def rehashed(name: str, cases: list[CaseResult], check: ModelCheck) -> None:
        """The graph's hash taken again once its runs are done, before its rows are shown."""
        changed = changed_since(out_dir, manifest.models[name])
        if changed:
            check.problems.append(changed)
        if on_model is not None:
            on_model(name, cases, check)

    with read_lock(out_dir, options.lock_wait_s, on_notice):
        return _verify_locked(out_dir, manifest, names, options, rehashed, parallelism)


def _verify_locked(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None,
    parallelism: Parallelism,
    run: Sequence[str] | None = None,
) -> VerifyReport:
    options.check()
    check_threads(options.threads)
    options = dataclasses.replace(options, threads=options.threads or physical_cores())
    started = time.perf_counter()
    report = VerifyReport(
        artifacts=str(out_dir),
        seed=options.seed,
        settings=options.settings(),
        manifest_sha256=manifest.sha256,
        versions=runtime_versions(),
    )
    entries = [manifest.models[name] for name in names]
    specs = [_judging_spec(e, options) for e in entries]
    if options.generate_steps:  # before any work: a prompt and its tokens must fit each model's ranges
        lms = [spec for spec in specs if is_causal_lm(spec)]
        others = [manifest.models[n].model_spec for n in (run or ()) if n in manifest.models]
        if not lms and not any(is_causal_lm(spec) for spec in others):  # a shard may hold none
            lm = "{generate_steps} runs causal LMs (a logits output and a KV cache): no model of this run is one"
            raise OptionError(lm, ["generate_steps"])
        for entry, spec in zip(entries, specs, strict=True):
            if is_causal_lm(spec):
                generate_prompts(spec, options.generate_steps, options.seed)
                if options.golden:  # the recorded generations are there, hold enough steps, and read
                    recorded_reference(out_dir, entry, spec, options)
    if options.scenario:  # every model fits it, before any work
        for spec in specs:
            scenario_sizes(spec, options.scenario)
    for name, spec in zip(names, specs, strict=True):
        if options.shapes:
            for sizes in options.shapes:
                validate_sizes(spec, sizes)
        check_mask_case(spec, options.mask_case, name)
    models = [_plan_model(out_dir, manifest, entry, spec, options) for entry, spec in zip(entries, specs, strict=True)]
    if not any(m.cases or m.decode or m.placement for m in models):
        parallelism = SERIAL  # nothing to run: no processes, no cluster
    try:
        with open_executor(parallelism) as executor:
            _run_models(executor, parallelism.parallel, models, options, report, on_model)
    finally:
        release()  # the graph this process kept for the next cell (one job runs cells here)
    if options.generate_steps:
        refused = {c.model for c in report.checks if not c.passed}  # a graph its checks refused is not run
        for entry, spec in zip(entries, specs, strict=True):
            if is_causal_lm(spec) and entry.name not in refused:
                report.generate += generate_model(out_dir, entry, spec, options)
    report.seconds = time.perf_counter() - started
    return report


def _judging_spec(entry: ManifestEntry, options: VerifyOptions) -> ModelSpec:
    """What a graph is judged by: its golden file's spec (data), else the spec file named for
    a graph no build made, else the checkout's spec of its name."""
    if options.golden:
        return entry.model_spec
    if options.spec_file is not None:
        return outside_spec(options.spec_file, entry)
    return checkout_spec(options.models_dir, entry)


@dataclass
class _Model:
    """One model's check and the cells that verify it."""

    check: ModelCheck
    cases: list[CaseCell] = field(default_factory=list)
    decode: DecodeCell | None = None
    #: Where ONNX Runtime ran each node, on every target (``placement``).
    placement: ModelWork | None = None
    results: list[CaseResult] = field(default_factory=list)
    timed: list[tuple[CaseCell, CaseResult]] = field(default_factory=list)
    trajectories: list[DecodeResult] = field(default_factory=list)
    placements: list[PlacementResult] = field(default_factory=list)


def _plan_model(
    out_dir: Path, manifest: Manifest, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions
) -> _Model:
    """The checks that come before any run (files intact, build current, graph sound), then
    the model's cells; a problem found planning them is a failed check, never an exception
    (except bad usage)."""
    kinds = (
        ("golden", *(("generations",) if options.generate_steps and entry.generations else ()))
        if options.golden
        else ()
    )
    model = _Model(ModelCheck(entry.name, entry.file, integrity(out_dir, entry, *kinds)))
    check = model.check
    if check.passed:
        stale = stale_against_checkout(options.models_dir, entry, spec, options.golden, options.golden_checkout)
        if stale:
            check.problems.append(
                f"{entry.name}: stale build: {'; '.join(stale)} since it was built from "
                f"{options.models_dir / (spec.name + '.toml')}; run attn-export build"
            )
    runnable = check.passed
    if runnable:
        problems, runnable, notes = graph_problems(out_dir, entry, outside=options.spec_file is not None)
        check.problems += problems
        check.notes += notes
    if not runnable:
        return model
    try:
        golden = read_model_golden(out_dir, entry, options)
        plain = plain_export(out_dir, manifest, entry)
        for target in options.targets:
            on_target = TargetWork(out_dir, entry, spec, options, plain, target)
            model.cases += [CaseCell(on_target, i) for i in range(_case_count(spec, target, options, golden))]
        work = ModelWork(out_dir, entry, spec, options)
        cache = cache_of(spec)
        if cache is not None and options.steps:
            model.decode = DecodeCell(work, cache)
        model.placement = work
    except UsageError:
        raise
    except AttnExportError as e:
        check.problems.append(str(e))
        model.cases, model.decode = [], None
    return model


def _case_count(spec: ModelSpec, target: Target, options: VerifyOptions, golden: list[GoldenCase]) -> int:
    """How many cases a target's sweep holds, known without running anything."""
    if options.inputs_file:
        budget = memory_budget(options.max_memory, spec)
        return len(read_recorded(options.inputs_file, budget))
    if options.golden:
        return len(golden_expected(golden).plan)
    return len(case_plan(spec, options, RUNTIMES[target.runtime].shape_cap))


#: Cases sent to a worker at once: the cells of one model x target in batches of this many,
#: so that a worker loads a graph once for several (each case stays its own cell and record).
BATCH = 8


def _run_models(
    executor: Executor,
    parallel: bool,
    models: list[_Model],
    options: VerifyOptions,
    report: VerifyReport,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None,
) -> None:
    """Every model's cells on ``executor``, the report filled in model order. Timing cells
    run one at a time, when no other cell runs: at once after a model's numbers with one job,
    after every model's numbers when cells run side by side."""

    def submit(model: _Model) -> tuple[list[Future[Any]], list[Future[Any]]]:
        cells = model.cases
        batches = [executor.submit(check_cases, tuple(cells[i : i + BATCH])) for i in range(0, len(cells), BATCH)]
        decode = [executor.submit(decode_cell, model.decode)] if model.decode else []
        return batches, decode + ([executor.submit(placement_cell, model.placement)] if model.placement else [])

    pending = [submit(m) for m in models] if parallel else []
    later = parallel and options.latency
    for i, model in enumerate(models):
        batches, others = pending[i] if parallel else submit(model)
        cases = [record for batch in batches for record in batch.result()]
        _collect(model, cases + [f.result() for f in others])
        if not later:
            _finish(executor, model, options, report, on_model)
    for model in models if later else []:
        _finish(executor, model, options, report, on_model)


def _collect(model: _Model, records: list[Record[Any]]) -> None:
    """A model's numbers from its cells' records, in cell order: its cases, its decode
    trajectories, its placement. The first problem fails the model's check and leaves out
    what comes after it in that order (as one run over them would have stopped there): a
    case's all the model's cases, the decode cell's the trajectories and placement, the
    placement cell's the placement."""
    n = len(model.cases)
    keys = [c.key for c in model.cases] + ([model.decode.key] if model.decode else [])
    keys += [placement_key(model.placement)] if model.placement else []
    if [r.key for r in records] != keys:  # records are matched to cells by content, never by luck
        raise RuntimeFailure(f"{model.check.model}: the executor returned records of other cells than were sent")
    values: list[Any] = [r.get() for r in records]  # bad usage ends the run
    problem = next((r.problem for r in records[:n] if r.problem is not None), None)
    if problem is not None:
        model.check.problems.append(problem)
        return
    for cell, (result, timed) in zip(model.cases, values[:n], strict=True):
        model.results.append(result)
        if timed:
            model.timed.append((cell, result))
    rest = list(zip(records[n:], values[n:], strict=True))
    if model.decode is not None:
        record, value = rest.pop(0)
        if record.problem is not None:
            model.check.problems.append(record.problem)
            return
        model.trajectories = value
    if model.placement is not None:
        record, value = rest.pop(0)
        if record.problem is not None:
            model.check.problems.append(record.problem)
            return
        gate_cases(model.results, value)
        model.placements = value


def _finish(
    executor: Executor,
    model: _Model,
    options: VerifyOptions,
    report: VerifyReport,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None,
) -> None:
    """Time the model's timed cases, one at a time, and add the model to the report."""
    for cell, result in model.timed:
        record = executor.submit(time_case, cell).result()
        stats = record.get()
        if stats is None:
            model.check.problems.append(str(record.problem))
            model.results, model.trajectories = [], []
            break
        set_latency(result, stats, options)
    report.checks.append(model.check)
    report.cases += model.results
    report.decode += model.trajectories
    report.placement += model.placements
    if on_model:
        on_model(model.check.model, model.results, model.check)


def verify_module(
    name: str, module: Any, spec: ModelSpec, path: Path, options: VerifyOptions, variant: str = "fp32"
) -> list[CaseResult]:
    """A PyTorch module against the graph at ``path`` on every target, over the sweep, judged
    by the one pass rule: what verify does for a built model, for a module in hand too."""
    cases: list[CaseResult] = []
    for target in options.targets:
        with TargetRun(name, path, spec, target, options, variant, module) as run:
            for i in range(len(run.expected.plan)):
                result = run.check(i)
                if run.timed(result):
                    set_latency(result, run.time(i), options)
                cases.append(result)
    return cases
