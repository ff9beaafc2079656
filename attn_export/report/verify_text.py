"""Terminal table for ``attn-export verify``: one row per model x runtime x shape."""

from __future__ import annotations

from attn_export.spec.masks import CASES
from attn_export.verify import CaseResult, ModelCheck, VerifyReport

__all__ = ["HEADER", "format_case", "format_failures", "format_model_rows", "format_summary"]

HEADER = (
    f"{'MODEL':<18} {'RUNTIME':<18} {'SHAPE':<30} {'RESULT':<6} {'MAX_ABS':>9} {'MAX_REL':>9} "
    f"{'TORCH_P50':>10} {'ORT_P50':>9} {'RATIO':>6}"
)


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def format_case(c: CaseResult) -> str:
    """One row, then the case's notes indented below it."""
    shape = ",".join(f"{k}={v}" for k, v in c.sizes.items()) + (f" {c.shape}" if c.shape in CASES else "")
    torch_ms = _num(c.torch_latency.p50_ms if c.torch_latency else None, ".3f", "ms")
    onnx_ms = _num(c.onnx_latency.p50_ms if c.onnx_latency else None, ".3f", "ms")
    return (
        f"{c.model:<18} {c.runtime:<18} {shape:<30} {'PASS' if c.passed else 'FAIL':<6} "
        f"{_num(c.max_abs_error, '9.2e'):>9} {_num(c.max_rel_error, '9.2e'):>9} "
        f"{torch_ms:>10} {onnx_ms:>9} {_num(c.ratio, '.2f', 'x'):>6}"
    ) + "".join(f"\n    note: {n}" for n in c.notes)


def format_model_rows(name: str, cases: list[CaseResult], check: ModelCheck) -> str:
    """The rows for one model, printed as soon as it is verified."""
    lines = [format_case(c) for c in cases]
    lines += [f"{name:<18} {'checks':<18} {'-':<30} FAIL    {p}" for p in check.problems]
    return "\n".join(lines)


def format_failures(report: VerifyReport) -> str:
    """Each failure's reasons and the command that reproduces it."""
    lines = []
    for check in report.checks:
        lines += [f"FAIL {p}" for p in check.problems]
    for c in report.failed_cases:
        lines.append(f"FAIL {c.model} {c.runtime} {c.shape} (seed {c.seed}): {'; '.join(c.reasons())}")
        lines.append(f"     reproduce: {report.reproduce(c)}")
    return "\n".join(lines)


def format_summary(report: VerifyReport) -> str:
    n = report.summary
    verdict = "PASSED" if report.passed else f"FAILED ({', '.join(report.failed_models)})"
    return (
        f"verify {verdict}: {n['cases'] - n['failed_cases']} of {n['cases']} cases agree across "
        f"{n['models']} models in {report.seconds:.1f} s (seed {report.seed})"
    )
