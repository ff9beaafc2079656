"""The pass rule's numbers, shared by specs, the variant table and the comparison."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Pass rule |actual - expected| <= atol + rtol * |expected|; NaN on both sides fails
    unless ``allow_nan`` (a module whose every output is NaN must not pass silently)."""

    atol: float
    rtol: float
    allow_nan: bool = False
