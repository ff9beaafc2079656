"""Terminal rendering of ``attn-export check``: a line per graph, its problems under it."""

from __future__ import annotations

from attn_export.pipelines.check import CheckReport, FileCheck

__all__ = ["format_check", "format_file_check"]


def format_file_check(f: FileCheck) -> str:
    verdict = "ok  " if f.passed else "FAIL"
    lines = [f"{verdict}  {f.path}  ({1000 * f.seconds:.0f} ms; {', '.join(f.results)})"]
    lines += [f"      {check}: {problem}" for check, problem in f.problems.items()]
    return "\n".join(lines)


def format_check(report: CheckReport) -> str:
    failed = sum(not f.passed for f in report.files)
    verdict = "check PASSED" if report.passed else "check FAILED"
    lines = [format_file_check(f) for f in report.files]
    lines.append(
        f"{verdict}: {len(report.files) - failed} of {len(report.files)} files pass every check "
        f"in {report.seconds:.2f} s"
    )
    return "\n".join(lines)
