"""JSON report: strict JSON (no NaN/Infinity tokens), read back by ``load_json_report``.

Non-finite floats are written as the strings "inf", "-inf" and "nan" (``json_text``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from attn_export.artifacts.files import read_regular, write_output
from attn_export.artifacts.json_fields import mistyped
from attn_export.artifacts.json_text import json_floats, json_text
from attn_export.errors import ArtifactError
from attn_export.report.base import BenchFormat, ReportFormat

if TYPE_CHECKING:
    from attn_export.pipelines.bench.results import BenchReport, DecodeBenchReport
    from attn_export.pipelines.verify import VerifyReport

__all__ = [
    "BENCH_FORMAT",
    "FORMAT",
    "dump_bench_json",
    "dump_json_report",
    "load_json_report",
    "read_json_report",
    "write_bench_json",
]


def dump_json_report(report: VerifyReport) -> str:
    return json_text(report.to_dict())


def load_json_report(text: str) -> VerifyReport:
    from attn_export.pipelines.verify import VerifyReport

    return VerifyReport.from_dict(json_floats(json.loads(text)))


#: A verify report is a few KiB per case; anything far beyond this is not one.
MAX_REPORT_BYTES = 1 << 30


def read_json_report(path: Path) -> VerifyReport:
    """A verify JSON report from a file, each field of the type the report gives it (checked
    as ``VerifyReport.from_dict`` reads it, then in the results it builds); ArtifactError,
    in one line, for anything else."""
    from attn_export.pipelines.verify import VerifyReport

    text = read_regular(path, None, MAX_REPORT_BYTES)
    not_one = f"{path}: not an attn-export verify report"
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{not_one} ({type(e).__name__}: {e})") from e
    if not isinstance(doc, dict) or doc.get("schema") != VerifyReport.SCHEMA:
        raise ArtifactError(not_one)
    try:
        report = VerifyReport.from_dict(json_floats(doc))
        where = mistyped(report, VerifyReport, "")
    except ArtifactError as e:
        raise ArtifactError(f"{not_one} ({e})") from e
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ArtifactError(f"{not_one} ({type(e).__name__}: {e})") from e
    if where is not None:
        raise ArtifactError(f"{not_one} ({where})")
    return report


FORMAT = ReportFormat("json", dump_json_report, "Write the JSON report here (-: stdout, instead of the text).")


def dump_bench_json(report: BenchReport | DecodeBenchReport) -> str:
    """Bench figures as JSON (``BenchReport.from_dict`` reads them back)."""
    return json_text(report.to_dict())


def write_bench_json(report: BenchReport | DecodeBenchReport, path: Path) -> None:
    write_output(path, dump_bench_json(report).encode())


BENCH_FORMAT = BenchFormat("json", write_bench_json, "Write the figures as JSON (-: stdout, instead of the table).")
