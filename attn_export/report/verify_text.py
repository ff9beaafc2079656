"""Terminal table for ``attn-export verify``: one row per model x runtime x shape."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from attn_export.compare.outputs import FLOOR_FACTOR, SIMULATED_CLAUSE
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.shapes import format_sizes, mask_cases
from attn_export.model_spec.variants import variant_chain
from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
from attn_export.report.verify_notes import unsimulated_cases, unsimulated_steps
from attn_export.runtimes.genai import GENAI

__all__ = [
    "VERIFY_WIDTHS",
    "VerifyWidths",
    "format_case",
    "format_decode",
    "format_generate",
    "format_distributions",
    "format_failures",
    "format_model_rows",
    "format_placement",
    "format_summary",
    "header",
]


@dataclass(frozen=True)
class VerifyWidths:
    """The widths of the MODEL, RUNTIME and SHAPE columns. Rows are printed as each model
    is verified, so the widths are fixed before the first: wide enough for every row."""

    model: int
    runtime: int
    shape: int

    def fitting(self, specs: Iterable[tuple[str, ModelSpec]], runtimes: Iterable[str]) -> VerifyWidths:
        """These widths, widened to every model name, runtime label and shape a run over
        ``specs`` (name, spec) can print (``_widest_shape``)."""
        specs = list(specs)
        return VerifyWidths(
            max([self.model, *(len(name) for name, _ in specs)]),
            max([self.runtime, *map(len, runtimes)]),
            max([self.shape, *(_widest_shape(spec) for _, spec in specs)]),
        )


def _widest_shape(spec: ModelSpec) -> int:
    """The longest SHAPE cell: sizes at most their dims' max, with a mask case's name
    (``--shapes`` and ``--mask-case`` may put one at any sizes)."""
    widest = len(format_sizes({d: r.max for d, r in spec.dims.items()}))
    return widest + max((1 + len(c) for c in mask_cases(spec)), default=0)


VERIFY_WIDTHS = VerifyWidths(18, 18, 30)


def header(w: VerifyWidths = VERIFY_WIDTHS) -> str:
    return (
        f"{'MODEL':<{w.model}} {'RUNTIME':<{w.runtime}} {'SHAPE':<{w.shape}} {'VALUES':<8} {'RESULT':<6} "
        f"{'MAX_ABS':>9} {'MAX_REL':>9} {'TORCH_P50':>10} {'ORT_P50':>9} {'RATIO':>6}"
    )


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def format_case(c: CaseResult, w: VerifyWidths = VERIFY_WIDTHS) -> str:
    """One row, then the case's notes indented below it."""
    shape = format_sizes(c.sizes) + (f" {c.shape}" if c.shape in CASES else "")
    torch_ms = _num(c.torch_latency.p50_ms if c.torch_latency else None, ".3f", "ms")
    onnx_ms = _num(c.onnx_latency.p50_ms if c.onnx_latency else None, ".3f", "ms")
    return (
        f"{c.model:<{w.model}} {c.runtime:<{w.runtime}} {shape:<{w.shape}} {c.distribution:<8} "
        f"{'PASS' if c.passed else 'FAIL':<6} "
        f"{_num(c.max_abs_error, '9.2e'):>9} {_num(c.max_rel_error, '9.2e'):>9} "
        f"{torch_ms:>10} {onnx_ms:>9} {_num(c.ratio, '.2f', 'x'):>6}" + ("  noisy" if c.noise else "")
    ) + "".join(f"\n    note: {n}" for n in c.notes)


def format_model_rows(name: str, cases: list[CaseResult], check: ModelCheck, w: VerifyWidths = VERIFY_WIDTHS) -> str:
    """The rows for one model, printed as soon as it is verified."""
    lines = [format_case(c, w) for c in cases]
    lines += [f"{name:<{w.model}} {'checks':<{w.runtime}} {'-':<{w.shape}} {'-':<8} FAIL   {p}" for p in check.problems]
    lines += [f"note: {n}" for n in check.notes]
    nan = sum(any((o.shared_nan or o.shared_inf) and o.passed for o in c.comparisons) for c in cases)
    if nan:  # passing, but not silently: the spec allowed it
        lines.append(
            f"note: {name}: NaN or Inf on both sides in {nan} of {len(cases)} cases, accepted by the spec's allow_nan"
        )
    widened = [(o.atol, f"{c.runtime} {c.shape} {c.distribution}") for c in cases for o in c.comparisons if o.widened]
    if widened:  # a green held to PyTorch's own error, not the spec's atol: say how loose
        atol, label = max(widened)
        lines.append(
            f"note: {name}: PyTorch's own rounding error (against float64) set the tolerance of {len(widened)} "
            f"outputs in {len(cases)} cases: atol = spec + {FLOOR_FACTOR:g}x that error, up to {atol:.3g} at {label}"
        )
    lines += [f"note: {name}: {n}" for n in unsimulated_cases(cases)]
    return "\n".join(lines)


def format_failures(report: VerifyReport) -> str:
    """Each failure's reasons and the command that reproduces it."""
    lines = []
    for check in report.checks:
        lines += [f"FAIL {p}" for p in check.problems]
    for c in report.failed_cases:
        lines.append(f"FAIL {c.model} {c.runtime} {c.shape} {c.distribution} (seed {c.seed}): {'; '.join(c.reasons())}")
        lines.append(f"     reproduce: {report.reproduce(c)}")
    for d in report.decode:
        lines += [f"FAIL {d.model} {d.runtime} decode {d.scenario}: {reason}" for reason in d.reasons()]
        lines += [] if d.passed else [f"     reproduce: {report.reproduce_decode(d)}"]
    failed = [o for c in report.failed_cases for o in c.comparisons if not o.passed]
    failed += [o for d in report.decode for s in d.steps for o in s.comparisons if not o.passed]
    if any(o.simulated for o in failed):
        lines.append(f"note: {SIMULATED_CLAUSE}")
    return "\n".join(lines)


def _report_widths(report: VerifyReport) -> VerifyWidths:
    """Widths fitting the models and runtimes of ``report``'s sections after the table
    (decode, placement, errors by values), which are printed once it is whole."""
    pairs = [(d.model, d.runtime) for d in report.decode] + [(p.model, p.runtime) for p in report.placement]
    pairs += list(report.errors_by_distribution)
    model = max([VERIFY_WIDTHS.model, *(len(m) for m, _ in pairs)])
    runtime = max([VERIFY_WIDTHS.runtime, *(len(r) for _, r in pairs)])
    return VerifyWidths(model, runtime, VERIFY_WIDTHS.shape)


def format_decode(report: VerifyReport) -> str:
    """One row per decode trajectory: its prompt lengths and the largest error at each step
    (step 1 is the prompt), so the step where an error starts to grow is in view."""
    if not report.decode:
        return ""
    w = _report_widths(report)
    lines = [f"{'DECODE':<{w.model}} {'RUNTIME':<{w.runtime}} {'LAYOUT':<12} {'PROMPTS':<8} RESULT MAX_ABS BY STEP"]
    for d in report.decode:
        prompts = ",".join(map(str, d.prompt_lengths))
        errors = " ".join(_num(s.max_abs_error, ".1e") for s in d.steps)
        lines.append(
            f"{d.model:<{w.model}} {d.runtime:<{w.runtime}} {d.scenario:<12} {prompts:<8} "
            f"{'PASS' if d.passed else 'FAIL':<6} {errors}"
        )
        lines += [f"    note: {n}" for n in [*d.notes, *unsimulated_steps(d)]]
    return "\n".join(lines)


def format_generate(report: VerifyReport) -> str:
    """One row per generation: who ran the graph, the prompts' lengths, the tokens agreeing and
    the largest logit difference; a divergence's line names its step, row, tokens and logit."""
    if not report.generate:
        return ""
    w = _report_widths(report)
    runner = max([w.runtime, *(len(g.runner) for g in report.generate)])
    layout = max([8, *(len(g.layout) for g in report.generate)])
    lines = [f"{'GENERATE':<{w.model}} {'RUNNER':<{runner}} {'LAYOUT':<{layout}} {'PROMPTS':<8} RESULT TOKENS  MAX_ABS"]
    for g in report.generate:
        prompts = ",".join(str(len(p)) for p in g.prompts)
        worst = _num(max(g.max_abs_by_step, default=None), ".1e")
        lines.append(
            f"{g.model:<{w.model}} {g.runner:<{runner}} {g.layout:<{layout}} {prompts:<8} "
            f"{'PASS' if g.passed else 'FAIL':<6} {g.agreed_of():<7} {worst}"
        )
    for g in report.generate:
        if g.divergence:
            lines += [f"FAIL {g.model} {g.runner} generate {g.layout}: {g.divergence}"]
            lines += [f"     reproduce: {report.reproduce_generation(g)}"]
    lines += [f"note: {g.model} {g.runner} generate {g.layout}: {tie}" for g in report.generate for tie in g.parted]
    without = sorted({g.model for g in report.generate} - {g.model for g in report.generate if g.runner == GENAI})
    if without:
        lines.append(
            f"note: onnxruntime-genai's generator did not run {', '.join(without)}: it is not installed (pip install "
            "'attn-export[genai]'), or the graph does not fit it (build --target genai says why)"
        )
    return "\n".join(lines)


def format_placement(report: VerifyReport) -> str:
    """Where each graph ran: one line when every node ran on the provider asked for, else a
    row per model and target with nodes elsewhere, by op type and count."""
    if not report.placement:
        return ""
    off = [p for p in report.placement if p.placement.fallbacks or p.placement.shape_ops or p.placement.error]
    if not off:
        models, targets = len({p.model for p in report.placement}), len({p.runtime for p in report.placement})
        nodes = sum(p.placement.nodes for p in report.placement)
        counts = f"models: {models}, targets: {targets}, nodes: {nodes}"
        return f"placement: every node ran on the provider asked for ({counts})"
    w = _report_widths(report)
    lines = [f"{'PLACEMENT':<{w.model}} {'RUNTIME':<{w.runtime}} {'RESULT':<6} WHERE"]
    lines += [f"{p.model:<{w.model}} {p.runtime:<{w.runtime}} {p.verdict:<6} {p.placement.summary()}" for p in off]
    return "\n".join(lines)


def format_distributions(report: VerifyReport) -> str:
    """Per model and runtime, the largest error under each value distribution: where a
    quantized or half-precision graph breaks."""
    lines = []
    w = _report_widths(report)
    for (model, runtime), errors in report.errors_by_distribution.items():
        cells = ", ".join(f"{d} {_num(e, '.2e')}" for d, e in errors.items())
        lines.append(f"max abs by values  {model:<{w.model}} {runtime:<{w.runtime}} {cells}")
    return "\n".join(lines + _extreme_only(report) + _by_rounding(report))


#: The distributions of values far from a model's usual ones (``model_spec.distributions``).
_EXTREME = ("large", "outliers")


def _extreme_only(report: VerifyReport) -> list[str]:
    """A note for each lossy variant that fails on extreme values alone: beyond its
    simulated rounding there, or judged by the shares alone where the simulation cannot run
    (which a right graph may fail), and how to judge it where such values never come."""
    by_model: dict[str, list[CaseResult]] = {}
    for c in report.cases:
        by_model.setdefault(c.model, []).append(c)
    notes = []
    for model, cases in by_model.items():
        variant = model.partition(".")[2]
        chain = variant_chain(variant) if variant else None
        failed = sorted({c.distribution for c in cases if not c.passed})
        if chain and chain.lossy and failed and set(failed) <= set(_EXTREME) and any(c.passed for c in cases):
            notes.append(
                f"note: {model} fails on {', '.join(failed)} values alone, beyond what {'+'.join(chain.lossy)}'s "
                "rounding of the module (simulated in PyTorch, where it runs) does there; where the simulation cannot "
                "run the shares of the rms alone judge, and a right graph may fail them: where such values never "
                f"come, judge it with --distribution normal --distribution tiny, or give [{chain.table}] atol_rms and "
                "rms_rtol"
            )
    return notes


def _by_rounding(report: VerifyReport) -> list[str]:
    """A note for each quantized or float16 graph that passed, somewhere beyond the shares of
    the rms alone but within what its rounding does to the module there
    (``OutputComparison.by_rounding``): the precision it loses where such values or lengths come."""
    found: dict[str, dict[str, float]] = {}
    failed = set(report.failed_models)
    for c in report.cases:
        for o in c.comparisons:
            if o.by_rounding and o.rms and c.model not in failed:
                worst = found.setdefault(c.model, {})
                worst[c.distribution] = max(worst.get(c.distribution, 0.0), o.max_abs_error / o.rms)
    notes = []
    for model, worst in found.items():
        distributions = ", ".join(sorted(worst))
        shares = ", ".join(f"{share:.2g}" for _, share in sorted(worst.items()))
        variant = model.partition(".")[2]
        lossy = variant_chain(variant).lossy if variant else ()
        kind = lossy[-1] if lossy else "int8"
        notes.append(
            f"note: {model} passes on {distributions} values only because {kind}'s own rounding of the module "
            f"(simulated in PyTorch) strays that far there: its worst element {shares} x the output's rms; {kind} "
            "loses that much precision where such values or lengths come"
        )
    return notes


def format_summary(report: VerifyReport) -> str:
    n = report.summary
    failed = ", ".join(report.failed_models) or "nothing was compared"
    verdict = "PASSED" if report.passed else f"FAILED ({failed})"
    line = (
        f"verify {verdict}: {n['cases'] - n['failed_cases']} of {n['cases']} cases agree across "
        f"{n['models']} models in {report.seconds:.1f} s (seed {report.seed})"
    )
    if n["failed_checks"]:
        line += f"; {n['failed_checks']} of {n['models']} models failed a check (FAIL lines above)"
    if report.decode:
        line += (
            f"; {n['decode_trajectories'] - n['failed_trajectories']} of {n['decode_trajectories']} decode "
            f"trajectories agree (up to {max(len(d.steps) for d in report.decode) - 1} steps after the prompt)"
        )
    if report.generate:
        line += (
            f"; {n['generations'] - n['failed_generations']} of {n['generations']} generations give PyTorch's "
            f"tokens ({report.generate[0].steps} tokens each)"
        )
    if n["noisy_timings"]:
        first = next(c.noise for c in report.cases if c.noise)
        line += (
            f"\n{n['noisy_timings']} cases have noisy timings ({first}): --max-slowdown fails only a "
            "slowdown beyond the noise; rerun on an idle machine before quoting their figures"
        )
    return line
