"""The pass rule's two numbers, shared by specs, the variant table and the comparison."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Pass rule |actual - expected| <= atol + rtol * |expected|."""

    atol: float
    rtol: float
