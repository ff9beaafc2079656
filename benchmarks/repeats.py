"""What the benchmark scripts share: a figure measured in several whole runs, printed as its
median with the lowest and highest in brackets (a ratio whose bracket holds 1.00 decides
nothing)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["spread"]


def spread(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """``median [lowest–highest]``, each formatted with ``fmt`` and followed by ``unit``."""
    return f"{statistics.median(values):{fmt}}{unit} [{min(values):{fmt}}–{max(values):{fmt}}]"
