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
from attn_export.compare import OutputComparison, latency_gate
from attn_export.errors import ArtifactError, AttnExportError, GraphCheckError, UsageError
from attn_export.export.graph_checks import check_dynamic_axes, check_model
from attn_export.fully_masked import FullyMaskedRows
from attn_export.runtimes import RUNTIMES, Runtime, Target
from attn_export.spec import ModelSpec, Tolerance
from attn_export.spec.inputs import make_feeds
from attn_export.spec.masks import CASES
from attn_export.spec.shapes import ShapePoint, mask_cases, sweep, validate_sizes
from attn_export.timing import LatencyStats, measure, physical_cores

__all__ = [
    "CaseResult",
    "ModelCheck",
    "VerifyOptions",
    "VerifyReport",
    "select_models",
    "shard_names",
    "verify_artifacts",
    "verify_module",
]


@dataclass
class VerifyOptions:
    """What ``attn-export verify`` was asked to do (defaults are the CLI's)."""

    targets: Sequence[Target] = (Target("onnxruntime", "cpu"),)
    golden: bool = False
    shapes: Sequence[Mapping[str, int]] | None = None
    n_random: int = 2
    seed: int = 0
    atol: float | None = None
    rtol: float | None = None
    latency: bool = True
    #: Threads for both PyTorch and ONNX Runtime; None means the physical cores.
    threads: int | None = None
    latency_budget_s: float = 0.05
    max_slowdown: float | None = None
    #: With ``shapes``: feed this named mask case (``masks.CASES``) instead of the pattern.
    mask_case: str | None = None

    def settings(self) -> dict[str, Any]:
        """The options as the JSON report records them."""
        return {
            "targets": [t.label for t in self.targets],
            "golden": self.golden,
            "threads": self.threads,
            "latency": self.latency,
            "atol": self.atol,
            "rtol": self.rtol,
            "max_slowdown": self.max_slowdown,
            "shapes": [dict(s) for s in self.shapes] if self.shapes else None,
            "mask_case": self.mask_case,
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
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and all(c.passed for c in self.cases)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def failed_cases(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    @property
    def failed_models(self) -> list[str]:
        return sorted({c.model for c in self.failed_cases} | {c.model for c in self.checks if not c.passed})

    @property
    def summary(self) -> dict[str, int]:
        return {
            "models": len(self.checks),
            "cases": len(self.cases),
            "failed_cases": len(self.failed_cases),
            "failed_checks": sum(not c.passed for c in self.checks),
        }

    def models(self) -> list[str]:
        return [c.model for c in self.checks]

    def reproduce(self, case: CaseResult) -> str:
        """The one command that reruns exactly this case."""
        file = next(c.file for c in self.checks if c.model == case.model)
        args = [str(Path(self.artifacts) / file), *case.target.cli_args()]
        if case.expected_from == "golden":
            args += ["--golden"]
        else:
            args += ["--shapes", ",".join(f"{k}={v}" for k, v in case.sizes.items()), "--seed", str(case.seed)]
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
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VerifyReport:
        return cls(
            artifacts=d["artifacts"],
            seed=d["seed"],
            settings=dict(d["settings"]),
            checks=[ModelCheck(c["model"], c["file"], list(c["problems"])) for c in d["checks"]],
            cases=[CaseResult.from_dict(c) for c in d["cases"]],
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
        got = sha256_file(out_dir / name)
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
        check_dynamic_axes(proto, entry.name, spec.inputs, spec.outputs)
    except GraphCheckError as e:
        return [str(e)], True
    return [], True


def _tolerances(spec: ModelSpec, variant: str, options: VerifyOptions) -> dict[str, Tolerance]:
    return {
        name: Tolerance(
            tol.atol if options.atol is None else options.atol, tol.rtol if options.rtol is None else options.rtol
        )
        for name, tol in spec.tolerances(variant).items()
    }


def _points(spec: ModelSpec, options: VerifyOptions, cap: int | None) -> list[ShapePoint]:
    if options.shapes:  # validated by verify_artifacts before any work
        case = options.mask_case
        return [
            ShapePoint(case or f"shape-{i}", {k: int(s[k]) for k in spec.dims}, case or ShapePoint.case)
            for i, s in enumerate(options.shapes)
        ]
    return sweep(spec, n_random=options.n_random, seed=options.seed, cap=cap)


@dataclass
class _Expected:
    """Expected outputs for a list of cases, and where they came from."""

    label: str
    cases: list[GoldenCase]
    seeds: list[int]


def _golden_expected(out_dir: Path, entry: ManifestEntry) -> _Expected:
    spec, path = entry.model_spec, out_dir / entry.golden
    cases = read_golden(path)
    for case in cases:
        for section, got, want in (("inputs", case.inputs, spec.inputs), ("outputs", case.outputs, spec.outputs)):
            names = sorted(t.name for t in want)
            if sorted(got) != names:
                raise ArtifactError(f"{path}: case '{case.label}' has {section} {sorted(got)}, expected {names}")
            for t in want:
                if got[t.name].dtype != np.dtype(t.dtype):
                    raise ArtifactError(
                        f"{path}: case '{case.label}' {section[:-1]} '{t.name}' has dtype {got[t.name].dtype}, "
                        f"expected {t.dtype}"
                    )
    return _Expected("golden", cases, list(range(len(cases))))


def _torch_expected(torch_rt: Runtime, spec: ModelSpec, points: list[ShapePoint], seed: int) -> _Expected:
    cases = []
    for i, point in enumerate(points):
        feeds = make_feeds(spec, point.sizes, seed + i, case=point.case)
        cases.append(GoldenCase(point.label, dict(point.sizes), feeds, torch_rt.run(feeds)))
    return _Expected(torch_rt.name, cases, [seed + i for i in range(len(points))])


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
    case.onnx_latency = measure(target.prepare(feeds), budget_s=budget)
    if torch_rt is not None:
        case.torch_latency = measure(torch_rt.prepare(feeds), budget_s=budget)


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
        CaseResult(model, target, c.label, dict(c.sizes), seed, expected.label)
        for c, seed in zip(expected.cases, expected.seeds, strict=True)
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
            if options.latency and RUNTIMES[target.runtime].timed:
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
) -> VerifyReport:
    """Verify each named model; problems become failed checks or cases, never exceptions,
    except bad usage (unknown provider, shapes outside the declared ranges)."""
    options = dataclasses.replace(options, threads=options.threads or physical_cores())
    started = time.perf_counter()
    report = VerifyReport(artifacts=str(out_dir), seed=options.seed, settings=options.settings())
    for name in names:
        entry = manifest.models[name]
        spec = entry.model_spec
        if options.shapes:
            for sizes in options.shapes:
                validate_sizes(spec, sizes)
        if options.mask_case and options.mask_case not in mask_cases(spec):
            raise UsageError(
                f"{name}: --mask-case {options.mask_case} does not apply (it has: {mask_cases(spec) or 'no mask'})"
            )
        check = ModelCheck(name, entry.file, _integrity(out_dir, entry, options.golden))
        report.checks.append(check)
        cases: list[CaseResult] = []
        runnable = check.passed
        if runnable:
            problems, runnable = _graph_problems(out_dir, entry)
            check.problems += problems
        if runnable:
            try:
                cases = _verify_model(out_dir, entry, options)
            except UsageError:
                raise
            except AttnExportError as e:
                check.problems.append(str(e))
        report.cases += cases
        if on_model:
            on_model(name, cases, check)
    report.seconds = time.perf_counter() - started
    return report


def _verify_model(out_dir: Path, entry: ManifestEntry, options: VerifyOptions) -> list[CaseResult]:
    spec, path = entry.model_spec, out_dir / entry.file
    if not options.golden:
        from attn_export.export.factory import instantiate

        return verify_module(entry.name, instantiate(spec), spec, path, options, entry.variant)
    expected = _golden_expected(out_dir, entry)
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
    from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

    cases: list[CaseResult] = []
    with FullyMaskedRows(spec, path, _tolerances(spec, variant, options)) as rows:
        for target in options.targets:
            kind = RUNTIMES[target.runtime]
            device = torch_device_for(target.provider) if kind.timed else "cpu"
            threads = options.threads if kind.timed else None
            with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims, device=device, threads=threads) as eager:
                expected = _torch_expected(eager, spec, _points(spec, options, kind.shape_cap), options.seed)
                runtime = kind.make(path, spec, target, options.threads)
                cases += _check_target(name, target, runtime, expected, rows, eager if kind.timed else None, options)
    return cases
