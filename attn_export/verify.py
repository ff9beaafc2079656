"""The verify pipeline: manifest -> integrity and graph checks -> expected outputs (PyTorch
or golden vectors) -> each target runs the sweep -> comparison -> timing -> a VerifyReport.

Verify measures and collects; ``compare.policy`` judges, and ``report/`` renders.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.golden import GoldenCase, read_golden
from attn_export.artifacts.manifest import Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.artifacts.recorded import RECORDED, read_recorded
from attn_export.compare import OutputComparison, latency_gate
from attn_export.compare.policy import noise as latency_noise
from attn_export.decode import (
    DEFAULT_STEPS,
    DecodeResult,
    Trajectory,
    compare_trajectories,
    pytorch_trajectories,
    recompute,
    run_trajectory,
    scenarios,
    split_recorded_label,
    unpadded,
)
from attn_export.errors import ArtifactError, AttnExportError, GraphCheckError, InputError, UsageError
from attn_export.export.graph_checks import check_deterministic, check_dynamic_axes, check_model
from attn_export.export.source import module_sources
from attn_export.fully_masked import FullyMaskedRows
from attn_export.runtimes import RUNTIMES, Runtime, Target, check_feeds
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.spec import ModelSpec, Tolerance, load_spec
from attn_export.spec.cache import cache_of
from attn_export.spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.spec.distributions import DISTRIBUTIONS, split_label
from attn_export.spec.inputs import make_feeds
from attn_export.spec.masks import CASES, PATTERN, keep_of
from attn_export.spec.memory import check_memory, memory_budget
from attn_export.spec.shapes import ShapePoint, format_sizes, mask_cases, sizes_from_feeds, sweep, validate_sizes
from attn_export.timing import LatencyStats, measure_alternating, physical_cores

__all__ = [
    "CaseResult",
    "ModelCheck",
    "VerifyOptions",
    "VerifyReport",
    "case_plan",
    "checkout_spec",
    "select_models",
    "shard_names",
    "verify_artifacts",
    "verify_module",
]


@dataclass
class VerifyOptions:
    """What ``attn-export verify`` was asked to do (defaults are the CLI's)."""

    targets: Sequence[Target] = (Target("onnxruntime", "cpu"),)
    #: The checkout's spec folder: PyTorch originals are rebuilt from these specs only.
    models_dir: Path = Path("models")
    golden: bool = False
    shapes: Sequence[Mapping[str, int]] | None = None
    #: Value distributions to run at every shape; None: unit normal everywhere, the others
    #: at the distinct and largest shapes.
    distributions: Sequence[str] | None = None
    #: Recorded inputs (``artifacts.recorded``) to verify with instead of the sweep.
    inputs_file: Path | None = None
    n_random: int = 2
    seed: int = 0
    atol: float | None = None
    rtol: float | None = None
    latency: bool = True
    #: Threads for both PyTorch and ONNX Runtime; None means the physical cores.
    threads: int | None = None
    latency_budget_s: float = 0.05
    max_slowdown: float | None = None
    #: Memory budget per case in bytes; None means the spec's ``max_memory``, else the machine's.
    max_memory: int | None = None
    #: With ``shapes``: feed this named mask case (``masks.CASES``) instead of the pattern.
    mask_case: str | None = None
    #: Decode steps after the prompt for models with a cache; None: ``decode.DEFAULT_STEPS``
    #: unless the run is narrowed to given shapes, values or inputs; 0: no decoding.
    decode_steps: int | None = None

    @property
    def steps(self) -> int:
        """The decode steps this run takes for a model with a cache."""
        if self.decode_steps is not None:
            return self.decode_steps
        narrowed = self.shapes or self.distributions or self.inputs_file or self.mask_case
        return 0 if narrowed else DEFAULT_STEPS

    def settings(self) -> dict[str, Any]:
        """The options as the JSON report records them."""
        return {
            "targets": [t.label for t in self.targets],
            "models": None if self.golden else str(self.models_dir),
            "golden": self.golden,
            "threads": self.threads,
            "latency": self.latency,
            "atol": self.atol,
            "rtol": self.rtol,
            "max_slowdown": self.max_slowdown,
            "max_memory": self.max_memory,
            "shapes": [dict(s) for s in self.shapes] if self.shapes else None,
            "distributions": list(self.distributions) if self.distributions else None,
            "inputs": str(self.inputs_file) if self.inputs_file else None,
            "mask_case": self.mask_case,
            "decode_steps": self.steps,
        }


@dataclass
class CaseResult:
    """One model x target x shape: numbers, errors and timings."""

    model: str
    target: Target
    shape: str
    sizes: dict[str, int]
    seed: int
    expected_from: str  # "torch[cpu]", "torch[cuda]" or "golden"
    comparisons: list[OutputComparison] = field(default_factory=list)
    error: str | None = None
    torch_latency: LatencyStats | None = None
    onnx_latency: LatencyStats | None = None
    gate: str | None = None
    #: The float inputs' value distribution (``spec.distributions``), or "recorded".
    distribution: str = DEFAULT_DISTRIBUTION
    #: What the report must say beside the numbers (what fully masked rows give, rows left out).
    notes: list[str] = field(default_factory=list)

    @property
    def runtime(self) -> str:
        return self.target.label

    @property
    def ratio(self) -> float | None:
        if self.torch_latency and self.onnx_latency and self.torch_latency.p50_ms > 0:
            return self.onnx_latency.p50_ms / self.torch_latency.p50_ms
        return None

    @property
    def noise(self) -> str | None:
        """Why this case's timings are too noisy to decide on, or None."""
        return latency_noise(self.onnx_latency, self.torch_latency)

    @property
    def max_abs_error(self) -> float | None:
        """The largest absolute error over outputs; None when nothing numeric was compared."""
        numeric = [c for c in self.comparisons if c.numeric]
        return max((c.max_abs_error for c in numeric), default=None) if numeric == self.comparisons else None

    @property
    def max_rel_error(self) -> float | None:
        numeric = [c for c in self.comparisons if c.numeric]
        return max((c.max_rel_error for c in numeric), default=None) if numeric == self.comparisons else None

    @property
    def passed(self) -> bool:
        return self.error is None and self.gate is None and all(c.passed for c in self.comparisons)

    def reasons(self) -> list[str]:
        out = [self.error] if self.error else []
        out += [c.reason() for c in self.comparisons if not c.passed]
        return out + ([self.gate] if self.gate else [])

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "runtime": self.runtime,
            "target": self.target.to_dict(),
            "shape": self.shape,
            "sizes": self.sizes,
            "seed": self.seed,
            "expected_from": self.expected_from,
            "distribution": self.distribution,
            "passed": self.passed,
            "error": self.error,
            "gate": self.gate,
            "notes": self.notes,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "latency": None
            if self.onnx_latency is None
            else {
                "onnx": self.onnx_latency.to_dict(),
                "torch": self.torch_latency.to_dict() if self.torch_latency else None,
                "ratio": self.ratio,
                "noise": self.noise,
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaseResult:
        lat = d.get("latency") or {}
        return cls(
            model=d["model"],
            target=Target(**d["target"]),
            shape=d["shape"],
            sizes=dict(d["sizes"]),
            seed=d["seed"],
            expected_from=d["expected_from"],
            distribution=d["distribution"],
            comparisons=[OutputComparison.from_dict(c) for c in d["comparisons"]],
            error=d.get("error"),
            gate=d.get("gate"),
            notes=list(d.get("notes", [])),
            onnx_latency=LatencyStats(**lat["onnx"]) if lat.get("onnx") else None,
            torch_latency=LatencyStats(**lat["torch"]) if lat.get("torch") else None,
        )


@dataclass
class ModelCheck:
    """Per-model checks that come before any run: artifact integrity and graph axes."""

    model: str
    file: str
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class VerifyReport:
    """Everything one verify run found; the JSON report is ``to_dict``."""

    artifacts: str
    seed: int
    settings: dict[str, Any]
    checks: list[ModelCheck] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)
    #: Decoding trajectories of the models with a cache.
    decode: list[DecodeResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            all(c.passed for c in self.checks)
            and all(c.passed for c in self.cases)
            and all(d.passed for d in self.decode)
        )

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def failed_cases(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    @property
    def failed_models(self) -> list[str]:
        failed = {c.model for c in self.failed_cases} | {d.model for d in self.decode if not d.passed}
        return sorted(failed | {c.model for c in self.checks if not c.passed})

    @property
    def errors_by_distribution(self) -> dict[tuple[str, str], dict[str, float | None]]:
        """Largest absolute error per (model, runtime) and value distribution; None where
        no number was compared."""
        out: dict[tuple[str, str], dict[str, float | None]] = {}
        for c in self.cases:
            errors = out.setdefault((c.model, c.runtime), {})
            worst = errors.get(c.distribution)
            value = c.max_abs_error
            errors[c.distribution] = value if worst is None else (worst if value is None else max(worst, value))
        return out

    @property
    def summary(self) -> dict[str, int]:
        return {
            "models": len(self.checks),
            "cases": len(self.cases),
            "failed_cases": len(self.failed_cases),
            "failed_checks": sum(not c.passed for c in self.checks),
            "noisy_timings": sum(c.noise is not None for c in self.cases),
            **(
                {"decode_trajectories": len(self.decode), "failed_trajectories": sum(not d.passed for d in self.decode)}
                if self.decode
                else {}
            ),
        }

    def models(self) -> list[str]:
        return [c.model for c in self.checks]

    def reproduce(self, case: CaseResult) -> str:
        """The one command that reruns exactly this case."""
        file = next(c.file for c in self.checks if c.model == case.model)
        args = [str(Path(self.artifacts) / file), *case.target.cli_args()]
        if case.distribution == RECORDED:
            args += ["--inputs", str(self.settings.get("inputs"))]
        models = self.settings.get("models")
        if models and models != "models":  # verify's default
            args += ["--models", models]
        if case.expected_from == "golden":
            args += ["--golden"]
        elif case.distribution != RECORDED:
            shape = format_sizes(case.sizes)
            args += ["--shapes", shape, "--seed", str(case.seed), "--distribution", case.distribution]
            args += ["--mask-case", case.shape] if case.shape in CASES else []
        return "attn-export verify " + " ".join(shlex.quote(a) for a in [*args, "--no-latency"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "attn-export/verify-report",
            "schema_version": 1,
            "artifacts": self.artifacts,
            "seed": self.seed,
            "settings": self.settings,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "summary": self.summary,
            "checks": [dataclasses.asdict(c) | {"passed": c.passed} for c in self.checks],
            "cases": [c.to_dict() | {"reproduce": self.reproduce(c)} for c in self.cases],
            "decode": [d.to_dict() for d in self.decode],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VerifyReport:
        return cls(
            artifacts=d["artifacts"],
            seed=d["seed"],
            settings=dict(d["settings"]),
            checks=[ModelCheck(c["model"], c["file"], list(c["problems"])) for c in d["checks"]],
            cases=[CaseResult.from_dict(c) for c in d["cases"]],
            decode=[DecodeResult.from_dict(t) for t in d.get("decode", [])],
            seconds=d["seconds"],
        )


def shard_names(names: Sequence[str], shard: tuple[int, int] | None) -> list[str]:
    """Deterministic round-robin over sorted names; shard is 1-based ``(i, n)``."""
    ordered = sorted(names)
    if shard is None:
        return ordered
    i, n = shard
    if not (n >= 1 and 1 <= i <= n):
        raise UsageError(f"--shard {i}/{n}: expected i/n with 1 <= i <= n")
    return [name for k, name in enumerate(ordered) if k % n == i - 1]


def select_models(paths: Sequence[Path]) -> tuple[Path, Manifest, list[str]]:
    """Resolve ``DIR`` or ``FILES...`` (all in one build folder) to a manifest and model names."""
    if not paths:
        raise UsageError("give a build folder or .onnx files from one")
    if len(paths) == 1 and paths[0].is_dir():
        manifest = load_manifest(paths[0])
        return paths[0], manifest, sorted(manifest.models)
    folders = {p.parent.resolve() for p in paths}
    if len(folders) != 1:
        raise UsageError("all files given to verify must come from one build folder")
    for p in paths:
        if p.is_dir():
            raise UsageError(f"{p}: give either one build folder or .onnx files")
        if not p.exists():
            raise ArtifactError(f"{p}: no such file")
    out_dir = paths[0].parent
    manifest = load_manifest(out_dir)
    by_file = {e.file: name for name, e in manifest.models.items()}
    names = []
    for p in paths:
        if p.name not in by_file:
            raise ArtifactError(f"{p}: not listed in {out_dir / 'manifest.json'}")
        names.append(by_file[p.name])
    return out_dir, manifest, names


def _integrity(out_dir: Path, entry: ManifestEntry, golden: bool) -> list[str]:
    problems = []
    files = [(entry.file, entry.sha256)] + ([(entry.golden, entry.golden_sha256)] if golden else [])
    for name, want in files:
        got = sha256_file(out_dir / name, out_dir)
        if got != want:
            problems.append(
                f"{entry.name}: {name} changed after the build: sha256 {got[:12]}... != manifest {want[:12]}..."
            )
    return problems


def _graph_problems(out_dir: Path, entry: ManifestEntry) -> tuple[list[str], bool]:
    """Problems found in the graph itself, and whether it is sound enough to run.

    A file that is not a loadable model is bad input (ArtifactError, exit 2). A graph the
    checker rejects is not run; one with wrong dynamic axes is, to show the consequences.
    """
    spec = entry.model_spec
    proto = load_model_file(out_dir / entry.file)
    try:
        check_model(proto, entry.name, out_dir / entry.file)
    except GraphCheckError as e:
        return [str(e)], False
    try:
        check_deterministic(proto, entry.name)
    except GraphCheckError as e:
        return [str(e)], False
    try:
        check_dynamic_axes(proto, entry.name, spec.inputs, spec.outputs, spec.dims)
    except GraphCheckError as e:
        return [str(e)], True
    return [], True


def _tolerances(spec: ModelSpec, variant: str, options: VerifyOptions) -> dict[str, Tolerance]:
    return {
        name: dataclasses.replace(
            tol,
            atol=tol.atol if options.atol is None else options.atol,
            rtol=tol.rtol if options.rtol is None else options.rtol,
        )
        for name, tol in spec.tolerances(variant).items()
    }


def case_plan(spec: ModelSpec, options: VerifyOptions, cap: int | None = None) -> list[tuple[ShapePoint, str]]:
    """(shape, value distribution) pairs: by default every shape with unit-normal values,
    and each other distribution at the distinct and the largest shapes. A shape that
    cannot fit the memory budget is refused before anything is allocated."""
    if options.shapes:  # validated by verify_artifacts before any work
        case = options.mask_case
        points = [
            ShapePoint(case or f"shape-{i}", spec.with_sums(s), case or PATTERN) for i, s in enumerate(options.shapes)
        ]
    else:
        points = sweep(spec, n_random=options.n_random, seed=options.seed, cap=cap)
    check_memory(spec, points, memory_budget(spec, options.max_memory))
    if options.distributions:
        return [(p, d) for d in options.distributions for p in points]
    extra = [p for p in points if p.label in ("distinct", "max")] or points
    return [(p, DEFAULT_DISTRIBUTION) for p in points] + [
        (p, d) for d in DISTRIBUTIONS if d != DEFAULT_DISTRIBUTION for p in extra
    ]


@dataclass
class _Expected:
    """Expected outputs for a list of cases, and where they came from."""

    label: str
    cases: list[GoldenCase]
    seeds: list[int]
    distributions: list[str]


def _golden_expected(golden: list[GoldenCase]) -> _Expected:
    cases = [c for c in golden if split_recorded_label(c.label) is None]  # decode steps: _decode_model's
    labels = [split_label(c.label) for c in cases]
    cases = [dataclasses.replace(c, label=label) for c, (label, _) in zip(cases, labels, strict=True)]
    return _Expected("golden", cases, list(range(len(cases))), [d for _, d in labels])


def _torch_expected(
    torch_rt: TorchRuntime, spec: ModelSpec, plan: list[tuple[ShapePoint, str]], seed: int
) -> _Expected:
    cases = []
    for i, (point, distribution) in enumerate(plan):
        feeds = make_feeds(spec, point.sizes, seed + i, case=point.case, distribution=distribution)
        outputs = torch_rt.run(feeds)
        floors = torch_rt.precision_floor(feeds, outputs)
        cases.append(GoldenCase(point.label, dict(point.sizes), feeds, outputs, floors))
    return _Expected(torch_rt.name, cases, [seed + i for i in range(len(plan))], [d for _, d in plan])


def _recorded_expected(spec: ModelSpec, path: Path, torch_rt: TorchRuntime | None = None) -> _Expected:
    """The user's recorded inputs, checked against the spec like any feeds; expected
    outputs from PyTorch, or (golden mode) from the file."""
    cases = read_recorded(path)
    for case in cases:
        try:
            check_feeds(case.inputs, spec.inputs, spec.dims)
        except InputError as e:
            raise InputError(f"{path}: case '{case.label}': {e}") from e
        case.sizes = sizes_from_feeds(spec.inputs, {k: v.shape for k, v in case.inputs.items()})
        if torch_rt is not None:
            case.outputs = torch_rt.run(case.inputs)
            case.floors = torch_rt.precision_floor(case.inputs, case.outputs)
        elif sorted(case.outputs) != sorted(t.name for t in spec.outputs):
            raise InputError(
                f"{path}: case '{case.label}' holds no expected outputs {[t.name for t in spec.outputs]}; "
                "golden mode needs them (<case>/outputs/<name>), or verify against PyTorch"
            )
    label = "golden" if torch_rt is None else torch_rt.name
    return _Expected(label, cases, [0] * len(cases), [RECORDED] * len(cases))


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
    """Both sides in alternating blocks (``timing.measure_alternating``), with the same threads."""
    calls = {"onnx": target.prepare(feeds)}
    if torch_rt is not None:
        calls["torch"] = torch_rt.prepare(feeds)
    stats = measure_alternating(calls, budget_s=2 * budget)
    case.onnx_latency, case.torch_latency = stats["onnx"], stats.get("torch")


def _check_target(
    model: str,
    target: Target,
    runtime: Runtime,
    expected: _Expected,
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


#: Spec fields that do not change the PyTorch original or how it is judged (build overrides).
_EXPORT_ONLY = ("description", "opset", "exporter")


def checkout_spec(models_dir: Path, entry: ManifestEntry) -> ModelSpec:
    """The checkout's spec for a built graph: the only source of code verify runs."""
    name = entry.model_spec.name
    path = models_dir / f"{name}.toml"
    if not path.is_file():
        raise UsageError(
            f"no spec for model '{name}' in {models_dir}: verify rebuilds PyTorch originals only from the "
            "checkout's specs (pass --models DIR), or compares with golden vectors (--golden)"
        )
    return load_spec(path)


def stale_reasons(entry: ManifestEntry, spec: ModelSpec) -> list[str]:
    """What changed in the checkout since the graph was built; empty when nothing did.

    Compares data only (the spec's fields, the weights' and module files' hashes): nothing
    the manifest names is imported or run."""
    built, now = entry.spec, spec.to_dict()
    fields = sorted(k for k in set(built) | set(now) if k not in _EXPORT_ONLY and built.get(k) != now.get(k))
    reasons = [f"spec field{'s' if len(fields) > 1 else ''} {', '.join(fields)} differ"] if fields else []
    if not fields and spec.weights.path is not None and spec.content_hash() != entry.spec_hash:
        reasons.append(f"weights file {built['weights']['path']} changed")
    sources = module_sources(spec)
    changed = sorted(k for k in set(entry.sources) | set(sources) if entry.sources.get(k) != sources.get(k))
    if changed:
        reasons.append(f"module source {', '.join(changed)} changed")
    return reasons


def verify_artifacts(
    out_dir: Path,
    manifest: Manifest,
    names: Sequence[str],
    options: VerifyOptions,
    on_model: Callable[[str, list[CaseResult], ModelCheck], None] | None = None,
) -> VerifyReport:
    """Verify each named model; problems become failed checks or cases, never exceptions,
    except bad usage (unknown provider, shapes outside the declared ranges, no spec in the
    checkout for a model verified against PyTorch)."""
    options = dataclasses.replace(options, threads=options.threads or physical_cores())
    started = time.perf_counter()
    report = VerifyReport(artifacts=str(out_dir), seed=options.seed, settings=options.settings())
    entries = [manifest.models[name] for name in names]
    specs = [e.model_spec if options.golden else checkout_spec(options.models_dir, e) for e in entries]
    for name, entry, spec in zip(names, entries, specs, strict=True):
        if options.shapes:
            for sizes in options.shapes:
                validate_sizes(spec, sizes)
        if options.mask_case and options.mask_case not in mask_cases(spec):
            raise UsageError(
                f"{name}: --mask-case {options.mask_case} does not apply (it has: {mask_cases(spec) or 'no mask'})"
            )
        check = ModelCheck(name, entry.file, _integrity(out_dir, entry, options.golden))
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
            problems, runnable = _graph_problems(out_dir, entry)
            check.problems += problems
        if runnable:
            try:
                # golden mode: the file is read once, for the sweep's cases and the decode steps alike
                golden = (
                    read_golden(out_dir / entry.golden, spec, memory_budget(spec, options.max_memory), out_dir)
                    if options.golden and not options.inputs_file
                    else []
                )
                cases = _verify_model(out_dir, entry, spec, options, golden)
                if cache_of(spec) is not None and options.steps:
                    report.decode += _decode_model(out_dir, entry, spec, options, golden)
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
        from attn_export.export.factory import instantiate

        return verify_module(entry.name, instantiate(spec), spec, path, options, entry.variant)
    expected = _recorded_expected(spec, options.inputs_file) if options.inputs_file else _golden_expected(golden)
    cases: list[CaseResult] = []
    with FullyMaskedRows(spec, path, _tolerances(spec, entry.variant, options)) as rows:
        for target in options.targets:
            runtime = RUNTIMES[target.runtime].make(path, spec, target, options.threads)
            cases += _check_target(entry.name, target, runtime, expected, rows, None, options)
    return cases


def verify_module(
    name: str, module: Any, spec: ModelSpec, path: Path, options: VerifyOptions, variant: str = "fp32"
) -> list[CaseResult]:
    """A PyTorch module against the graph at ``path`` on every target, over the sweep, judged
    by the one pass rule: what verify does for a built model, for a module in hand too."""
    from attn_export.runtimes.torch_eager import torch_device_for

    cases: list[CaseResult] = []
    with FullyMaskedRows(spec, path, _tolerances(spec, variant, options)) as rows:
        for target in options.targets:
            kind = RUNTIMES[target.runtime]
            device = torch_device_for(target.provider) if kind.timed else "cpu"
            threads = options.threads if kind.timed else None
            with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims, device=device, threads=threads) as eager:
                if options.inputs_file:
                    expected = _recorded_expected(spec, options.inputs_file, eager)
                else:
                    expected = _torch_expected(eager, spec, case_plan(spec, options, kind.shape_cap), options.seed)
                runtime = kind.make(path, spec, target, options.threads)
                cases += _check_target(name, target, runtime, expected, rows, eager if kind.timed else None, options)
    return cases


def _decode_model(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions, golden: list[GoldenCase]
) -> list[DecodeResult]:
    """Every scenario's trajectory on every target: against PyTorch (and PyTorch against its
    own recompute and its rows alone), or in golden mode against what build recorded."""
    path = out_dir / entry.file
    tolerances = _tolerances(spec, entry.variant, options)
    # (trajectory, expected outputs, recomputed outputs per step, each padded row alone)
    plans: list[
        tuple[Trajectory, list[dict[str, np.ndarray]], list[dict[str, np.ndarray] | None], list[OutputComparison]]
    ]
    if options.golden:
        recorded = _recorded_trajectories(out_dir / entry.golden, golden, spec, options)
        plans = [(traj, outputs, [], []) for traj, outputs in recorded]
        expected_from = "golden"
    else:
        from attn_export.export.factory import instantiate

        with TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims) as eager:
            plans = [
                (
                    traj,
                    outputs,
                    [recompute(eager, spec, traj, k + 1) for k in range(len(outputs))],
                    unpadded(eager, spec, traj, outputs, tolerances) if traj.scenario == "left-padded" else [],
                )
                for traj, outputs in pytorch_trajectories(eager, spec, options.steps, options.seed)
            ]
        expected_from = eager.name
    results = []
    for target in options.targets:
        with RUNTIMES[target.runtime].make(path, spec, target, options.threads) as runtime:
            for traj, expected, full, alone in plans:
                actual, error = run_trajectory(runtime, spec, traj)
                result = DecodeResult(
                    entry.name,
                    target,
                    traj.scenario,
                    expected_from,
                    traj.prompt_lengths,
                    unpadded=alone,
                    notes=traj.notes,
                )
                result.steps = compare_trajectories(spec, traj, expected, actual, tolerances, error, full)
                results.append(result)
    return results


def _recorded_trajectories(
    path: Path, cases: list[GoldenCase], spec: ModelSpec, options: VerifyOptions
) -> list[tuple[Trajectory, list[dict[str, np.ndarray]]]]:
    """The trajectories build recorded in the golden file: each step's feeds (the pasts
    are replaced by the graph's own presents when replayed) and PyTorch's outputs. Every
    scenario must be there, its steps from the prompt on without a gap."""
    cache = cache_of(spec)
    assert cache is not None
    by_scenario: dict[str, dict[int, GoldenCase]] = {}
    for case in cases:
        where = split_recorded_label(case.label)
        if where is not None:
            by_scenario.setdefault(where[0], {})[where[1]] = case
    out = []
    for scenario in scenarios(spec):
        recorded = by_scenario.get(scenario, {})
        count = len(recorded)
        if not recorded or sorted(recorded) != list(range(1, count + 1)) or recorded[1].sizes[cache.past_dim] != 0:
            raise ArtifactError(
                f"{path}: the decode recording of '{scenario}' is missing or has gaps (steps {sorted(recorded)}); "
                "rebuild with attn-export build"
            )
        steps = [recorded[k] for k in range(1, min(count, options.steps + 1) + 1)]
        notes = (
            [f"{len(steps) - 1} of {options.steps} decode steps: the recording has {count - 1}"]
            if count <= options.steps
            else []
        )
        prompt = steps[0].sizes[cache.seq_dim]
        mask = next(t for t in spec.inputs if t.name == cache.mask) if cache.mask else None
        keep = (
            keep_of(mask.convention or "attend", steps[-1].inputs[mask.name])
            if mask is not None
            else np.ones((steps[0].inputs[cache.pairs[0][0]].shape[0], prompt + len(steps) - 1), dtype=bool)
        )
        sizes = [spec.with_sums(c.sizes) for c in steps]
        out.append(
            (
                Trajectory(
                    scenario,
                    keep,
                    prompt,
                    [c.inputs for c in steps],
                    sizes,
                    notes=notes,
                    floors=[c.floors for c in steps],
                ),
                [c.outputs for c in steps],
            )
        )
    return out
