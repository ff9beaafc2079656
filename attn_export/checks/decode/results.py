"""Decode results: one step of a trajectory (``DecodeStep``) and one model x target x
scenario trajectory (``DecodeResult``), plain dataclasses that round-trip through JSON and
say, from their comparisons, where a trajectory first failed and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from attn_export.artifacts.json_fields import json_field, json_object, refuse_unknown
from attn_export.checks.cache_growth import CacheCarry, CacheGrowth
from attn_export.compare import OutputComparison
from attn_export.runtimes.target import Target

__all__ = ["DecodeResult", "DecodeStep"]

#: How a cache's outputs are named (``model_spec.cache``): present.<i>.key / .value.
_PRESENT = "present."


@dataclass
class DecodeStep:
    """One step of a trajectory: the graph against the expected side, and (PyTorch mode)
    the cached module against its own full recompute."""

    step: int
    #: The cached positions fed as its past, and its new tokens.
    past: int
    seq: int
    comparisons: list[OutputComparison] = field(default_factory=list)
    recompute: list[OutputComparison] = field(default_factory=list)
    error: str | None = None
    #: Presents that did not grow as declared, on either side (``checks.cache_growth``).
    growth: list[CacheGrowth] = field(default_factory=list)
    #: Its first token's place in the whole sequence (more than ``past`` once a sliding
    #: window dropped tokens); None, as a report without it reads back: ``past``.
    start: int | None = None
    #: The graph's presents that changed what they carry over from their past (``cache_carry``).
    carry: list[CacheCarry] = field(default_factory=list)

    @property
    def first(self) -> int:
        """Its first token's place in the whole sequence."""
        return self.past if self.start is None else self.start

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.comparisons)

    @property
    def consistent(self) -> bool:
        """Whether the module's cache agrees with recomputing every token."""
        return all(c.passed for c in self.recompute)

    @property
    def max_abs_error(self) -> float | None:
        numeric = [c.max_abs_error for c in self.comparisons if c.numeric]
        return max(numeric) if numeric and len(numeric) == len(self.comparisons) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "past": self.past,
            "seq": self.seq,
            "passed": self.passed,
            "consistent": self.consistent,
            "max_abs_error": self.max_abs_error,
            "error": self.error,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "recompute": [c.to_dict() for c in self.recompute],
            "growth": [g.to_dict() for g in self.growth],
            "start": self.start,
            "carry": [c.to_dict() for c in self.carry],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "step") -> DecodeStep:
        """The step ``to_dict`` wrote; ArtifactError naming the first field (``where.past``)
        missing or not of its type: a step is read from a report from anywhere."""
        d = json_object(d, where)
        result = cls(
            json_field(d, "step", int, where),
            json_field(d, "past", int, where),
            json_field(d, "seq", int, where),
            _comparisons(d, "comparisons", where, required=True),
            _comparisons(d, "recompute", where, required=True),
            json_field(d, "error", str | None, where, None),
            [CacheGrowth.from_dict(g, f"{where}.growth[{i}]") for i, g in enumerate(_optional(d, "growth", where))],
            json_field(d, "start", int | None, where, None),
            [CacheCarry.from_dict(c, f"{where}.carry[{i}]") for i, c in enumerate(_optional(d, "carry", where))],
        )
        refuse_unknown(d, result.to_dict(), where)
        return result


@dataclass
class DecodeResult:
    """One model x target x scenario trajectory."""

    model: str
    target: Target
    scenario: str
    expected_from: str
    prompt_lengths: list[int]
    steps: list[DecodeStep] = field(default_factory=list)
    error: str | None = None
    #: PyTorch: each left-padded row's real tokens alone, against the batch's.
    unpadded: list[OutputComparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def runtime(self) -> str:
        return self.target.label

    @property
    def first_divergence(self) -> DecodeStep | None:
        """The first step where the graph left the expected side."""
        return next((s for s in self.steps if not s.passed), None)

    @property
    def module_bug(self) -> DecodeStep | None:
        """The first step where the module's cache disagrees with its own recompute."""
        return next((s for s in self.steps if not s.consistent), None)

    @property
    def cache_growth(self) -> DecodeStep | None:
        """The first step where a present, the graph's or PyTorch's, did not grow as declared."""
        return next((s for s in self.steps if s.growth), None)

    @property
    def cache_carry(self) -> DecodeStep | None:
        """The first step where the graph changed what a present carries over from its past."""
        return next((s for s in self.steps if s.carry), None)

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.first_divergence is None
            and self.module_bug is None
            and self.cache_growth is None
            and self.cache_carry is None
            and all(c.passed for c in self.unpadded)
        )

    def reasons(self) -> list[str]:
        out = [self.error] if self.error else []
        grew = self.cache_growth
        if grew is not None:
            out.append(grew.growth[0].reason(grew.step))
        carry = self.cache_carry
        if carry is not None:
            out.append(carry.carry[0].reason(carry.step))
        bug = self.module_bug
        if bug is not None:
            why = next(c.reason() for c in bug.recompute if not c.passed)
            out.append(
                f"module bug: with its cache the module disagrees with one pass over every token, from step "
                f"{bug.step} (past {bug.past}, seq {bug.seq}): its rows {bug.first} to {bug.first + bug.seq - 1} "
                f"differ from the same rows of the pass: {why}"
            )
        padded = next((c for c in self.unpadded if not c.passed), None)
        if padded is not None and all(c.passed for c in self.unpadded if not c.name.startswith(_PRESENT)):
            out.append(
                f"module bug: the cache differs, not the outputs: a left-padded row's tokens, alone and unpadded, "
                f"give every output the batch gave them but another {padded.name}: {padded.reason()}"
            )
        elif padded is not None:
            out.append(
                "module bug: padding changes what a real token sees: a left-padded row's tokens, alone and "
                f"unpadded, give other outputs: {padded.reason()}"
            )
        first = self.first_divergence
        if first is not None:
            why = first.error or next(c.reason() for c in first.comparisons if not c.passed)
            out.append(f"first divergence at step {first.step} (past {first.past}, seq {first.seq}): {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        first, bug, grew = self.first_divergence, self.module_bug, self.cache_growth
        return {
            "model": self.model,
            "runtime": self.runtime,
            "target": self.target.to_dict(),
            "scenario": self.scenario,
            "expected_from": self.expected_from,
            "prompt_lengths": self.prompt_lengths,
            "passed": self.passed,
            "error": self.error,
            "first_divergence": first.step if first else None,
            "module_bug_from_step": bug.step if bug else None,
            "cache_growth_from_step": grew.step if grew else None,
            "cache_carry_from_step": carry.step if (carry := self.cache_carry) else None,
            "reasons": self.reasons(),
            "notes": self.notes,
            "unpadded": [c.to_dict() for c in self.unpadded],
            "steps": [s.to_dict() for s in self.steps],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "decode") -> DecodeResult:
        """The trajectory ``to_dict`` wrote; ArtifactError naming the first field
        (``where.steps[1].past``) missing or not of its type: a trajectory is read from a
        shard's report, which can come from anywhere."""
        d = json_object(d, where)
        result = cls(
            json_field(d, "model", str, where),
            Target.of_result(d, where),
            json_field(d, "scenario", str, where),
            json_field(d, "expected_from", str, where),
            list(json_field(d, "prompt_lengths", list[int], where)),
            [DecodeStep.from_dict(s, f"{where}.steps[{i}]") for i, s in enumerate(json_field(d, "steps", list, where))],
            json_field(d, "error", str | None, where, None),
            _comparisons(d, "unpadded", where),
            list(json_field(d, "notes", list[str], where, [])),
        )
        refuse_unknown(d, result.to_dict(), where)
        return result


def _optional(d: Mapping[str, Any], key: str, where: str) -> list[Any]:
    """The list ``d[key]``, [] where it is absent (a report written before it was recorded)."""
    found: list[Any] = json_field(d, key, list, where, [])
    return found


def _comparisons(d: Mapping[str, Any], key: str, where: str, required: bool = False) -> list[OutputComparison]:
    """The comparisons in the list ``d[key]`` (where absent: [], unless ``required``)."""
    found = json_field(d, key, list, where) if required else _optional(d, key, where)
    return [OutputComparison.from_dict(c, f"{where}.{key}[{i}]") for i, c in enumerate(found)]
