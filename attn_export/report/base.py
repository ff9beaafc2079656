"""What a report format is: a name (its ``--<name> FILE`` option) and what writes it; one
table for verify's reports (``FORMATS``), one for bench's (``BENCH_FORMATS``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attn_export.pipelines.bench.results import BenchReport, DecodeBenchReport
    from attn_export.pipelines.verify import VerifyReport

__all__ = ["BenchFormat", "ReportFormat"]


@dataclass(frozen=True)
class ReportFormat:
    """One row of ``report.FORMATS``."""

    name: str
    render: Callable[[VerifyReport], str]
    help: str


@dataclass(frozen=True)
class BenchFormat:
    """One row of ``report.BENCH_FORMATS``: a file ``bench`` (and ``bench --decode``) writes."""

    name: str
    write: Callable[[BenchReport | DecodeBenchReport, Path], None]
    help: str
    #: An optional package the format needs, checked before anything is timed.
    requires: str | None = None
    #: The file suffixes it writes (any, where empty), checked before anything is timed.
    suffixes: tuple[str, ...] = ()
