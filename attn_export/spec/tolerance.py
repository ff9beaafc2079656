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

    def then(self, after: Tolerance) -> Tolerance:
        """The tolerance of a chain of two approximations: a graph ``y1`` within ``self`` of
        the truth ``y``, transformed into ``y2`` within ``after`` of ``y1``.

        Errors add, they do not take turns: ``|y2 - y| <= |y2 - y1| + |y1 - y| <= (a2 + r2|y1|)
        + (a1 + r1|y|)`` and ``|y1| <= a1 + (1 + r1)|y|``, so ``atol = a1 + a2 + r2 a1`` and
        ``1 + rtol = (1 + r1)(1 + r2)``. The larger of the two would be unsound: both links
        may reach their bound, in the same direction, on the same element. Composing is
        associative, so a chain folds its links left to right; NaN passes only where every
        link allows it."""
        return Tolerance(
            self.atol + after.atol + after.rtol * self.atol,
            self.rtol + after.rtol + self.rtol * after.rtol,
            self.allow_nan and after.allow_nan,
        )
