"""JSON report: strict JSON (no NaN/Infinity tokens), read back by ``load_json_report``.

Non-finite floats are written as the strings "inf", "-inf" and "nan" (``json_text``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attn_export.artifacts.files import read_regular, write_output
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


#: What a JSON value is called in a message.
_JSON_KINDS = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "an object",
}
_JSON_KINDS[type(None)] = "null"


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _mistyped(value: Any, hint: Any, where: str) -> str | None:
    """Where in ``value`` a field is not of the type ``hint`` says (``cases[0].seed: a str,
    not an int``), or None: a report's fields are read as they were written, and a string
    where a number belongs failed later, in merging or rendering."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return None
        if len(arms) == 1:
            return _mistyped(value, arms[0], where)
        return None if any(_mistyped(value, a, where) is None for a in arms) else f"{where}: not {_type_name(hint)}"
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, hint):
        hints = typing.get_type_hints(hint)
        fields = dataclasses.fields(hint)
        found = (_mistyped(getattr(value, f.name), hints[f.name], f"{where}.{f.name}".lstrip(".")) for f in fields)
        return next((w for w in found if w), None)
    kind = origin or hint
    numbers = {float: (int, float), int: (int,)}.get(kind)
    if numbers is not None:
        fits = isinstance(value, numbers) and not isinstance(value, bool)
    elif isinstance(kind, type) and issubclass(kind, Mapping):
        fits = isinstance(value, Mapping)
        if fits and args:
            found = (
                _mistyped(k, args[0], f"{where} key") or _mistyped(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()
            )
            return next((w for w in found if w), None)
    elif isinstance(kind, type) and issubclass(kind, Sequence) and kind is not str:
        fits = isinstance(value, list | tuple)
        if fits and args:
            found = (_mistyped(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
            return next((w for w in found if w), None)
    else:
        fits = not isinstance(kind, type) or isinstance(value, kind)
    return None if fits else f"{where}: {_JSON_KINDS.get(type(value), type(value).__name__)}, not {_type_name(hint)}"


def read_json_report(path: Path) -> VerifyReport:
    """A verify JSON report from a file, each field of the type the report gives it;
    ArtifactError, in one line, for anything else."""
    from attn_export.pipelines.verify import VerifyReport

    try:
        doc = json.loads(read_regular(path, None, MAX_REPORT_BYTES))
        if not isinstance(doc, dict) or doc.get("schema") != VerifyReport.SCHEMA:
            raise ArtifactError(f"{path}: not an attn-export verify report")
        report = VerifyReport.from_dict(json_floats(doc))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ArtifactError(f"{path}: not an attn-export verify report ({type(e).__name__}: {e})") from e
    where = _mistyped(report, VerifyReport, "")
    if where is not None:
        raise ArtifactError(f"{path}: not an attn-export verify report ({where})")
    return report


FORMAT = ReportFormat("json", dump_json_report, "Write the JSON report here (-: stdout, instead of the text).")


def dump_bench_json(report: BenchReport | DecodeBenchReport) -> str:
    """Bench figures as JSON (``BenchReport.from_dict`` reads them back)."""
    return json_text(report.to_dict())


def write_bench_json(report: BenchReport | DecodeBenchReport, path: Path) -> None:
    write_output(path, dump_bench_json(report).encode())


BENCH_FORMAT = BenchFormat("json", write_bench_json, "Write the figures as JSON (-: stdout, instead of the table).")
