"""What each case should give: PyTorch's outputs over the sweep, the golden vectors, or the
user's recorded inputs, with the tolerances the options set."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from attn_export.artifacts.golden import GoldenCase, Sight
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.artifacts.recorded import RECORDED, read_recorded
from attn_export.checks.causality import sights
from attn_export.checks.decode.recording import split_recorded_label
from attn_export.errors import InputError
from attn_export.exporter.variants.int4 import int4_compute, simulated_on
from attn_export.model_spec import ModelSpec, Tolerance
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.distributions import DISTRIBUTIONS, split_label
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.masks import PATTERN
from attn_export.model_spec.memory import check_memory, memory_budget
from attn_export.model_spec.scenarios import scenario_sizes
from attn_export.model_spec.shapes import ShapePoint, example_sizes, sizes_from_feeds, sweep
from attn_export.model_spec.tolerance import on_a_cpu
from attn_export.pipelines.verify.results import VerifyOptions
from attn_export.runtimes import Target, check_feeds
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = [
    "Expected",
    "PlannedCase",
    "case_plan",
    "golden_expected",
    "int4_activations",
    "recorded_expected",
    "target_tolerances",
    "tolerances_for",
    "torch_expected",
]


def tolerances_for(spec: ModelSpec, variant: str, options: VerifyOptions) -> dict[str, Tolerance]:
    """Each output's tolerance for ``variant``: ``--atol`` replaces the absolute allowance
    (atol, and a lossy variant's share of the output's rms and what its simulated rounding
    makes), ``--rtol`` the relative one; the share of the rms the error's rms may reach
    beyond atol (``rms_rtol``) stays the spec's."""
    return {name: _with_options(tol, options) for name, tol in spec.tolerances(variant).items()}


def _with_options(tol: Tolerance, options: VerifyOptions) -> Tolerance:
    return dataclasses.replace(
        tol,
        atol=tol.atol if options.atol is None else options.atol,
        atol_rms=tol.atol_rms if options.atol is None else 0.0,
        int8_rounding=tol.int8_rounding and options.atol is None,
        rtol=tol.rtol if options.rtol is None else options.rtol,
    )


def target_tolerances(
    spec: ModelSpec, variant: str, options: VerifyOptions, target: Target, graph: Path
) -> dict[str, Tolerance]:
    """``tolerances_for`` as ``target`` is judged: on ONNX Runtime's CPU, an int4 ``graph``
    that rounds as the simulation does against the simulated module
    (``model_spec.tolerance.on_a_cpu``)."""
    tolerances = tolerances_for(spec, variant, options)
    exact = spec.simulated_tolerances(variant)
    if exact is None or not simulated_on(target, load_model_file(graph)):
        return tolerances
    return on_a_cpu(tolerances, {name: _with_options(tol, options) for name, tol in exact.items()})


def int4_activations(graph: Path, bits: Collection[int] = (4,)) -> bool:
    """Whether int4's simulation standing for ``graph`` rounds its activations (MatMulNBits
    at accuracy level 4), or its weights alone (levels 0 and 1, computed in float on a CPU):
    ``TorchRuntime.int4_activations``; the graph is read only where ``bits`` (the simulations
    a variant is judged by) hold int4's."""
    return 4 not in bits or int4_compute(load_model_file(graph)) != "float"


def case_plan(spec: ModelSpec, options: VerifyOptions, cap: int | None = None) -> list[tuple[ShapePoint, str]]:
    """(shape, value distribution) pairs over the sweep, ``--shapes`` or a ``--scenario``'s
    steps: by default every shape with unit-normal values,
    and each other distribution at the distinct and the largest shapes. A shape that
    cannot fit the memory budget is refused before anything is allocated."""
    if options.shapes:  # validated by verify_artifacts before any work
        case = options.mask_case
        points = [
            ShapePoint(case or f"shape-{i}", spec.with_sums(s), case or PATTERN) for i, s in enumerate(options.shapes)
        ]
    elif options.scenario:
        steps = scenario_sizes(spec, options.scenario)
        points = [ShapePoint(f"{options.scenario}-{k + 1}", s) for k, s in enumerate(steps)]
    else:
        points = sweep(spec, n_random=options.n_random, seed=options.seed, cap=cap)
    check_memory(spec, points, memory_budget(options.max_memory, spec))
    if options.distributions:
        return [(p, d) for d in options.distributions for p in points]
    extra = [p for p in points if p.label in ("distinct", "max")] or points
    return [(p, DEFAULT_DISTRIBUTION) for p in points] + [
        (p, d) for d in DISTRIBUTIONS if d != DEFAULT_DISTRIBUTION for p in extra
    ]


@dataclass(frozen=True)
class PlannedCase:
    """A case as known before anything runs: its label, sizes, seed and value distribution."""

    label: str
    sizes: dict[str, int]
    seed: int
    distribution: str


@dataclass
class Expected:
    """The cases of a sweep and where their expected outputs come from. ``case(i)`` makes
    case i alone (PyTorch runs then, unless ``outputs`` is False), so that each cell of a
    sweep makes only its own."""

    label: str
    plan: list[PlannedCase]
    make: Callable[[int, bool], GoldenCase]

    def case(self, i: int, outputs: bool = True) -> GoldenCase:
        return self.make(i, outputs)


def _given(label: str, cases: list[GoldenCase], seeds: list[int], distributions: list[str]) -> Expected:
    plan = [
        PlannedCase(c.label, dict(c.sizes), seed, d) for c, seed, d in zip(cases, seeds, distributions, strict=True)
    ]
    return Expected(label, plan, lambda i, outputs: cases[i])


def golden_expected(golden: list[GoldenCase]) -> Expected:
    cases = [c for c in golden if split_recorded_label(c.label) is None]  # decode steps: _decode_model's
    labels = [split_label(c.label) for c in cases]
    cases = [dataclasses.replace(c, label=label) for c, (label, _) in zip(cases, labels, strict=True)]
    return _given("golden", cases, list(range(len(cases))), [d for _, d in labels])


def torch_expected(torch_rt: TorchRuntime, spec: ModelSpec, plan: list[tuple[ShapePoint, str]], seed: int) -> Expected:
    seen = sights(spec, torch_rt, example_sizes(spec), [p.sizes for p, _ in plan])

    def make(i: int, outputs: bool) -> GoldenCase:
        point, distribution = plan[i]
        feeds = make_feeds(spec, point.sizes, seed + i, case=point.case, distribution=distribution)
        if not outputs:
            return GoldenCase(point.label, dict(point.sizes), feeds, {}, sights=dict(seen))
        got = torch_rt.run(feeds)
        floors, int8 = torch_rt.allowances(feeds, got)
        return GoldenCase(point.label, dict(point.sizes), feeds, got, floors, int8, dict(seen))

    cases = [PlannedCase(p.label, dict(p.sizes), seed + i, d) for i, (p, d) in enumerate(plan)]
    return Expected(torch_rt.name, cases, make)


def recorded_expected(
    spec: ModelSpec,
    path: Path,
    budget: int,
    torch_rt: TorchRuntime | None = None,
    golden_sights: Mapping[str, Sight] | None = None,
) -> Expected:
    """The user's recorded inputs, checked against the spec like any feeds and against the
    memory budget (the file's declared sizes before loading, each case's floor before it
    runs); expected outputs from PyTorch (when a case is made), or (golden mode) from the file.
    What a query sees is PyTorch's answer, or in golden mode the build's (``golden_sights``), never the
    file's: it decides which padded rows are compared."""
    cases = [dataclasses.replace(c, sights=dict(golden_sights or {})) for c in read_recorded(path, budget)]
    for case in cases:
        try:
            check_feeds(case.inputs, spec.inputs, spec.dims)
        except InputError as e:
            raise InputError(f"{path}: case '{case.label}': {e}") from e
        case.sizes = sizes_from_feeds(spec.inputs, {k: v.shape for k, v in case.inputs.items()})
        check_memory(spec, [ShapePoint(case.label, spec.with_sums(case.sizes))], budget)
        if torch_rt is None and sorted(case.outputs) != sorted(t.name for t in spec.outputs):
            raise InputError(
                f"{path}: case '{case.label}' holds no expected outputs {[t.name for t in spec.outputs]}; "
                "golden mode needs them (<case>/outputs/<name>), or verify against PyTorch"
            )
    expected = _given("golden", cases, [0] * len(cases), [RECORDED] * len(cases))
    if torch_rt is None:
        return expected
    seen = sights(spec, torch_rt, example_sizes(spec), [c.sizes for c in cases])

    def make(i: int, outputs: bool) -> GoldenCase:
        case = dataclasses.replace(cases[i], sights=dict(seen))
        if outputs and torch_rt is not None:
            got = torch_rt.run(case.inputs)
            floors, int8 = torch_rt.allowances(case.inputs, got)
            case = dataclasses.replace(case, outputs=got, floors=floors, int8=int8)
        return case

    return Expected(torch_rt.name, expected.plan, make)
