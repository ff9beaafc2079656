"""Notes verify's renderers share, made from a report's results: where a case or a decode
step was judged without the int4 simulated values it is held to."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attn_export.checks.decode.results import DecodeResult, DecodeStep
    from attn_export.pipelines.verify.results import CaseResult

__all__ = ["unsimulated_cases", "unsimulated_steps"]


def unsimulated_cases(cases: list[CaseResult]) -> list[str]:
    """One model's cases whose outputs had no simulated values (``OutputComparison.not_simulated``):
    judged at int4's own room instead, pass or fail, so a green says it was not the strict one."""
    found = [(f"{c.runtime} {c.shape} {c.distribution}", why) for c in cases if (why := _why(c))]
    return _note(found, len(cases), "cases")


def unsimulated_steps(d: DecodeResult) -> list[str]:
    """The same of one decode trajectory's steps."""
    return _note([(f"step {s.step}", why) for s in d.steps if (why := _why(s))], len(d.steps), "steps")


def _why(judged: CaseResult | DecodeStep) -> str:
    return next((o.not_simulated for o in judged.comparisons if o.not_simulated), "")


def _note(found: list[tuple[str, str]], total: int, unit: str) -> list[str]:
    """``found``: where and why, one per case or step, the first first."""
    if not found:
        return []
    where, why = found[0]
    return [
        f"{len(found)} of {total} {unit} judged without the simulated values they are held to, at int4's own "
        f"room of the float module, which a fault smaller than int4's rounding passes; first at {where}: {why}"
    ]
