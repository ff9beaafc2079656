"""The verify pipeline: manifest -> integrity and graph checks -> expected outputs (PyTorch
or golden vectors) -> each target runs the sweep -> comparison -> timing -> a VerifyReport.

Verify measures and collects; ``compare.latency`` judges, and ``report/`` renders.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.artifacts.files import read_lock
from attn_export.artifacts.golden import GoldenCase, read_golden
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest
from attn_export.checks.fully_masked import FullyMaskedRows
from attn_export.compare import latency_gate
from attn_export.errors import ArtifactError, AttnExportError, UsageError
from attn_export.pipelines.verify.decode import decode_model
from attn_export.pipelines.verify.expected import (
    Expected,
    case_plan,
    golden_expected,
    recorded_expected,
    tolerances_for,
    torch_expected,
)
from attn_export.pipelines.verify.models import checkout_spec, graph_problems, integrity, stale_reasons
from attn_export.pipelines.verify.placement import gate_cases, model_placement
from attn_export.pipelines.verify.results import CaseResult, ModelCheck, VerifyOptions, VerifyReport
from attn_export.runtimes import RUNTIMES, Runtime, Target
from attn_export.runtimes.timing import check_threads, measure_alternating, physical_cores
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.spec import ModelSpec
from attn_export.spec.cache import cache_of
from attn_export.spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.spec.memory import memory_budget
from attn_export.spec.scenarios import scenario_sizes
from attn_export.spec.shapes import check_mask_case, validate_sizes

__all__ = ["verify_artifacts", "verify_module"]


def _run(runtime: Runtime, feeds: Mapping[str, np.ndarray], case: CaseResult) -> dict[str, np.ndarray] | None:
    """The runtime's outputs, or None with ``case.error`` set when it fails."""
    try:
        return runtime.run(feeds)
    except UsageError:
        raise
    except AttnExportError as e:
        case.error = str(e)
        return None


def _time(
    case: CaseResult, target: Runtime, torch_rt: Runtime | None, feeds: Mapping[str, np.ndarray], budget: float
) -> None:
    """Both sides in alternating blocks (``runtimes.timing.measure_alternating``), with the same threads."""
    calls = {"onnx": target.prepare(feeds)}
    if torch_rt is not None:
        calls["torch"] = torch_rt.prepare(feeds)
    stats = measure_alternating(calls, budget_s=2 * budget)
    case.onnx_latency, case.torch_latency = stats["onnx"], stats.get("torch")


def _check_target(
    model: str,
    target: Target,
    runtime: Runtime,
    expected: Expected,
    rows: FullyMaskedRows,
    torch_rt: Runtime | None,
    options: VerifyOptions,
) -> list[CaseResult]:
    """Run ``runtime`` on every expected case: compare, time where the kind is timed, gate."""
    results = [
        CaseResult(model, target, c.label, dict(c.sizes), seed, expected.label, distribution=d)
        for c, seed, d in zip(expected.cases, expected.seeds, expected.distributions, strict=True)
    ]
    try:
        runtime.activate()
    except UsageError:
        raise
    except AttnExportError as e:
        for r in results:
            r.error = str(e)
        return results
    try:
        for result, case in zip(results, expected.cases, strict=True):
            got = _run(runtime, case.inputs, result)
            if got is None:
                continue
            result.comparisons, result.notes = rows.compare(case, got, (expected.label, result.runtime))
            if options.latency and RUNTIMES[target.runtime].timed and result.distribution == DEFAULT_DISTRIBUTION:
                _time(result, runtime, torch_rt, case.inputs, options.latency_budget_s)
                result.gate = latency_gate(result.onnx_latency, result.torch_latency, options.max_slowdown)
    finally:
        runtime.deactivate()
    return results


def verify_artifacts(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Verify each named model; problems become failed checks or cases, never exceptions,
    except bad usage (unknown provider, shapes outside the declared ranges, no spec in the
    checkout for a model verified against PyTorch). The folder is read under a shared lock:
    a build in progress is waited for (``on_notice`` hears it once), and ``manifest`` is read
    again once it is done."""
    with read_lock(out_dir, options.lock_wait_s, on_notice):
        if (out_dir / MANIFEST_NAME).is_file():
            manifest = load_manifest(out_dir)
        missing = [n for n in names if n not in manifest.models]
        if missing:
            raise ArtifactError(f"{out_dir}: the manifest no longer lists {', '.join(missing)}")
        return _verify_locked(out_dir, manifest, names, options, on_model)


def _verify_locked(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None,
) -> VerifyReport:
    options.check()
    check_threads(options.threads)
    if not options.golden and options.models_dir.resolve().is_relative_to(out_dir.resolve()):
        raise UsageError(
            f"--models {options.models_dir} is inside the build folder {out_dir}: verify runs code only from the "
            "checkout, never from a build folder; pass --models with the checkout's spec folder"
        )
    options = dataclasses.replace(options, threads=options.threads or physical_cores())
    started = time.perf_counter()
    report = VerifyReport(artifacts=str(out_dir), seed=options.seed, settings=options.settings())
    entries = [manifest.models[name] for name in names]
    specs = [e.model_spec if options.golden else checkout_spec(options.models_dir, e) for e in entries]
    if options.scenario:  # every model fits it, before any work
        for spec in specs:
            scenario_sizes(spec, options.scenario)
    for name, entry, spec in zip(names, entries, specs, strict=True):
        if options.shapes:
            for sizes in options.shapes:
                validate_sizes(spec, sizes)
        check_mask_case(spec, options.mask_case, name)
        check = ModelCheck(name, entry.file, integrity(out_dir, entry, *(("golden",) if options.golden else ())))
        report.checks.append(check)
        if check.passed and not options.golden:
            stale = stale_reasons(entry, spec)
            if stale:
                check.problems.append(
                    f"{name}: stale build: {'; '.join(stale)} since it was built from "
                    f"{options.models_dir / (spec.name + '.toml')}; run attn-export build"
                )
        cases: list[CaseResult] = []
        runnable = check.passed
        if runnable:
            problems, runnable = graph_problems(out_dir, entry)
            check.problems += problems
        if runnable:
            try:
                # golden mode: the file is read once, for the sweep's cases and the decode steps alike
                golden = (
                    read_golden(out_dir / entry.golden, spec, memory_budget(options.max_memory), out_dir)
                    if options.golden and not options.inputs_file
                    else []
                )
                cases = _verify_model(out_dir, entry, spec, options, golden)
                cache = cache_of(spec)
                if cache is not None and options.steps:
                    report.decode += decode_model(out_dir, entry, spec, cache, options, golden)
                # after every timed run: a profiled session never runs beside one
                placements = model_placement(name, out_dir / entry.file, spec, options)
                gate_cases(cases, placements)
                report.placement += placements
            except UsageError:
                raise
            except AttnExportError as e:
                check.problems.append(str(e))
        report.cases += cases
        if on_model:
            on_model(name, cases, check)
    report.seconds = time.perf_counter() - started
    return report


def _verify_model(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions, golden: list[GoldenCase]
) -> list[CaseResult]:
    """``spec`` is the manifest's (golden mode: data only, ``golden`` the file's cases) or
    the checkout's (PyTorch mode)."""
    path = out_dir / entry.file
    if not options.golden:
        from attn_export.exporter.factory import instantiate

        return verify_module(entry.name, instantiate(spec), spec, path, options, entry.variant)
    budget = memory_budget(options.max_memory)  # the manifest's spec is data: its max_memory is not obeyed
    expected = recorded_expected(spec, options.inputs_file, budget) if options.inputs_file else golden_expected(golden)
    cases: list[CaseResult] = []
    with FullyMaskedRows(spec, path, tolerances_for(spec, entry.variant, options), budget) as rows:
        for target in options.targets:
            runtime = RUNTIMES[target.runtime].make(path, spec, target, options.threads, budget)
            cases += _check_target(entry.name, target, runtime, expected, rows, None, options)
    return cases


def verify_module(
    name: str, module: Any, spec: ModelSpec, path: Path, options: VerifyOptions, variant: str = "fp32"
) -> list[CaseResult]:
    """A PyTorch module against the graph at ``path`` on every target, over the sweep, judged
    by the one pass rule: what verify does for a built model, for a module in hand too."""
    from attn_export.runtimes.torch_eager import torch_device_for

    cases: list[CaseResult] = []
    budget = memory_budget(options.max_memory, spec)
    with FullyMaskedRows(spec, path, tolerances_for(spec, variant, options), budget) as rows:
        for target in options.targets:
            kind = RUNTIMES[target.runtime]
            device = torch_device_for(target.provider) if kind.timed else "cpu"
            threads = options.threads if kind.timed else None
            with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims, device=device, threads=threads) as eager:
                if options.inputs_file:
                    expected = recorded_expected(spec, options.inputs_file, budget, eager)
                else:
                    expected = torch_expected(eager, spec, case_plan(spec, options, kind.shape_cap), options.seed)
                runtime = kind.make(path, spec, target, options.threads, budget)
                cases += _check_target(name, target, runtime, expected, rows, eager if kind.timed else None, options)
    return cases
