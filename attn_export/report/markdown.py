"""Markdown report, for pull requests and GitHub's job summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attn_export.report.base import ReportFormat
from attn_export.report.verify_notes import unsimulated_cases, unsimulated_steps

if TYPE_CHECKING:
    from attn_export.pipelines.verify import VerifyReport

__all__ = ["FORMAT", "markdown_report"]


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_report(report: VerifyReport) -> str:
    verdict = "✅ passed" if report.passed else "❌ failed"
    lines = [
        f"### attn-export verify: {verdict}",
        "",
        f"{report.summary['models']} models, {report.summary['cases']} cases, seed {report.seed}, "
        f"{report.seconds:.1f} s.",
        "",
        "| model | runtime | shape | values | result | max abs | max rel | torch p50 (ms) | ORT p50 (ms) | ratio |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in report.cases:
        shape = ", ".join(f"{k}={v}" for k, v in c.sizes.items())
        lines.append(
            f"| {c.model} | {c.runtime} | {shape} | {c.distribution} | {'PASS' if c.passed else '**FAIL**'} | "
            f"{_cell(c.max_abs_error, '.2e')} | "
            f"{_cell(c.max_rel_error, '.2e')} | "
            f"{_cell(c.torch_latency.p50_ms if c.torch_latency else None, '.3f')} | "
            f"{_cell(c.onnx_latency.p50_ms if c.onnx_latency else None, '.3f')} | "
            f"{_cell(c.ratio, '.2f')}{' (noisy)' if c.noise else ''} |"
        )
    by_distribution = report.errors_by_distribution
    if by_distribution:
        names = list(dict.fromkeys(d for errors in by_distribution.values() for d in errors))
        lines += ["", "#### Max abs error by value distribution", ""]
        lines += ["| model | runtime | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
        for (model, runtime), errors in by_distribution.items():
            cells = " | ".join(_cell(errors.get(n), ".2e") for n in names)
            lines.append(f"| {model} | {runtime} | {cells} |")
    if report.decode:
        lines += ["", "#### Decoding with a KV cache (max abs error by step; step 1 is the prompt)", ""]
        lines += ["| model | runtime | layout | prompts | result | by step |", "|---|---|---|---|---|---|"]
        for d in report.decode:
            by_step = " ".join(_cell(s.max_abs_error, ".1e") for s in d.steps)
            prompts = ",".join(map(str, d.prompt_lengths))
            verdict = "PASS" if d.passed else "**FAIL**"
            lines.append(f"| {d.model} | {d.runtime} | {d.scenario} | {prompts} | {verdict} | {by_step} |")
    if report.generate:
        lines += ["", "#### Greedy generation (tokens as PyTorch's, largest logit difference)", ""]
        lines += ["| model | runner | layout | prompts | result | tokens | max abs |", "|---|---|---|---|---|---|---:|"]
        for g in report.generate:
            verdict = "PASS" if g.passed else "**FAIL**"
            prompts = ",".join(str(len(p)) for p in g.prompts)
            worst = _cell(max(g.max_abs_by_step, default=None), ".1e")
            lines.append(f"| {g.model} | {g.runner} | {g.layout} | {prompts} | {verdict} | {g.agreed_of()} | {worst} |")
    if report.placement:
        lines += ["", "#### Provider placement (where each node ran)", ""]
        lines += ["| model | runtime | nodes | result | where |", "|---|---|---:|---|---|"]
        for p in report.placement:
            lines.append(
                f"| {p.model} | {p.runtime} | {p.placement.nodes} | {'**FAIL**' if not p.passed else p.verdict} | "
                f"{p.placement.summary()} |"
            )
    problems = [f"- **{c.model}**: {p}" for c in report.checks for p in c.problems]
    for d in report.decode:
        reasons = [f"- **{d.model}** {d.runtime} decode {d.scenario}: {r}" for r in d.reasons()]
        problems += [*reasons[:-1], f"{reasons[-1]}  \n  `{report.reproduce_decode(d)}`"] if reasons else []
    problems += [
        f"- **{g.model}** {g.runner} generate {g.layout}: {g.divergence}  \n  `{report.reproduce_generation(g)}`"
        for g in report.generate
        if g.divergence
    ]
    problems += [
        f"- **{c.model}** {c.runtime} {c.shape}: {'; '.join(c.reasons())}  \n  `{report.reproduce(c)}`"
        for c in report.failed_cases
    ]
    if problems:
        lines += ["", "#### Failures", "", *problems]
    notes = [f"- **{c.model}**: {n}" for c in report.checks for n in c.notes]  # the region check's among them
    notes += [f"- **{c.model}** {c.runtime} {c.shape}: {n}" for c in report.cases for n in c.notes]
    for model in dict.fromkeys(c.model for c in report.cases):
        notes += [f"- **{model}**: {n}" for n in unsimulated_cases([c for c in report.cases if c.model == model])]
    notes += [
        f"- **{d.model}** {d.runtime} decode {d.scenario}: {n}"
        for d in report.decode
        for n in [*d.notes, *unsimulated_steps(d)]
    ]
    if notes:
        lines += ["", "#### Notes", "", *notes]
    return "\n".join(lines) + "\n"


FORMAT = ReportFormat(
    "markdown", markdown_report, "Write a Markdown report here (also appended to $GITHUB_STEP_SUMMARY when set)."
)
