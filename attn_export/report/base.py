"""What a verify report format is: a name (its ``--<name> FILE`` option) and a renderer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attn_export.pipelines.verify import VerifyReport

__all__ = ["ReportFormat"]


@dataclass(frozen=True)
class ReportFormat:
    """One row of ``report.FORMATS``."""

    name: str
    render: Callable[[VerifyReport], str]
    help: str
