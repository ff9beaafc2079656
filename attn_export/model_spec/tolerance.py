"""The pass rule's numbers, shared by specs, the variant table and the comparison."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Rounding", "Tolerance", "on_a_cpu", "rounding_bits", "rounding_key", "rounding_name"]


def rounding_bits(tolerances: Iterable[Tolerance]) -> tuple[int, ...]:
    """The weight quantizations whose rounding ``tolerances`` are judged by: the simulations
    a run needs (each is a forward pass per case)."""
    return tuple(sorted({t.weight_bits for t in tolerances if t.int8_rounding}, reverse=True))


def on_a_cpu(tolerances: Mapping[str, Tolerance], exact: Mapping[str, Tolerance] | None) -> dict[str, Tolerance]:
    """``tolerances`` as ONNX Runtime's CPU is judged where its graph rounds as the
    simulation of int4 does (accuracy level 4: int8 kernels, which the simulation reproduces
    to float32 noise, ``runtimes.int8_rounding``): an int4 output against the simulated
    module at ``exact`` (``ModelSpec.simulated_tolerances``, as ``Tolerance.simulated``), as
    ``verify --generate`` holds its logits. int4's own room (its rounding of the float
    module, up to several times the output's rms on large values) passed a layer whose block
    scales were 5 % off. Unchanged where ``exact`` is None; another provider computes int4
    in float."""
    return {
        name: dataclasses.replace(tol, simulated=exact[name])
        if exact is not None and tol.int8_rounding and tol.weight_bits == 4
        else tol
        for name, tol in tolerances.items()
    }


def rounding_name(bits: int) -> str:
    """The variant whose rounding ``bits`` stands for: int8, int4, or fp16 (16)."""
    return "fp16" if bits == 16 else f"int{bits}"


def rounding_key(bits: int, output: str) -> str:
    """The key of ``output``'s simulated rounding at ``bits`` in a case's table."""
    return output if bits == 8 else f"{rounding_name(bits)}:{output}"


@dataclass(frozen=True)
class Tolerance:
    """Pass rule |actual - expected| <= atol + atol_rms * rms + rtol * |expected|, where rms
    is the root mean square of the expected output on that case; NaN on both sides fails
    unless ``allow_nan`` (a module whose every output is NaN must not pass silently).

    ``atol_rms`` is for graphs whose error grows with the values (int8, float16): a fixed
    atol is as large as small outputs themselves, hiding a wrong scale, and smaller than
    the rounding of large ones, failing a right graph. ``rms_rtol`` (0: not checked) bounds
    the whole output's error as well, its root mean square at most ``atol`` plus that share
    of the output's rms: quantization noise has a long tail element by element (a right
    int8 graph reaches 0.14 x rms at its worst element) but a small rms, while a wrong scale
    or zero point moves every element and shows there.

    ``int8_rounding`` widens both bounds by what the int8 rounding does to the module on the
    case (``Rounding``, measured in PyTorch): how far a right int8 graph strays grows with
    the context and the values, past what any fixed share of the rms holds. ``weight_bits``
    names which rounding: 8 (``int8``, quantize_dynamic), 4 (``int4``, MatMulNBits blocks)
    or 16 (``fp16``, float16 inside); a case records each under its own key
    (``rounding_key``).

    ``simulated`` (set per target, never by a spec): where the variant's rounding is
    simulated to float32 noise on the target (int4 on ONNX Runtime's CPU), the tolerance
    a graph is held to against the simulated module's values (``Rounding.values``), beyond
    what near ties of the rounding move them (``Rounding.ties``); this one then judges only
    where the simulation did not run."""

    atol: float
    rtol: float
    allow_nan: bool = False
    atol_rms: float = 0.0
    rms_rtol: float = 0.0
    int8_rounding: bool = False
    weight_bits: int = 8
    simulated: Tolerance | None = None

    def rounding_key(self, output: str) -> str:
        """Where a case's table of simulated roundings holds ``output``'s under this
        tolerance's quantization: the output's name for int8 (as golden files have always
        recorded it), ``int4:<output>`` for int4."""
        return rounding_key(self.weight_bits, output)

    @property
    def rms_share(self) -> float:
        """The share of the output's rms its error's rms may reach beyond ``atol``: ``rms_rtol``,
        or where that is not checked what the per-element bound allows."""
        return self.rms_rtol or self.atol_rms + self.rtol

    def then(self, after: Tolerance) -> Tolerance:
        """The tolerance of a chain of two approximations: a graph ``y1`` within ``self`` of
        the truth ``y``, transformed into ``y2`` within ``after`` of ``y1``.

        Errors add, they do not take turns. With ``R`` the rms of ``y``: ``|y1 - y| <= a1 +
        b1 R + r1|y|``, so ``|y1| <= a1 + b1 R + (1 + r1)|y|`` and ``rms(y1) <= a1 + (1 + b1 +
        r1) R``; adding ``|y2 - y1| <= a2 + b2 rms(y1) + r2|y1|`` gives ``atol = a1 + a2 + (b2
        + r2) a1`` (taken as ``max(b2 + r2, c2) a1``, to hold for the rms bound below too),
        ``atol_rms = b1 + b2 (1 + b1 + r1) + r2 b1`` and ``1 + rtol = (1 + r1)(1 + r2)``.
        The larger of the two would be unsound: both links may reach their bound, in the
        same direction, on the same element. The rms of the errors adds the same way
        (``rms_share``, ``c``): ``rms(y2 - y) <= a1 + a2 + c2 a1 + (c1 + c2 (1 + c1)) R``,
        checked where a link checks it. Composing is associative, so a chain folds its links
        left to right; NaN passes only where every link allows it, and a link's
        ``int8_rounding`` holds for the chain."""
        a1, b1, r1, c1 = self.atol, self.atol_rms, self.rtol, self.rms_share
        a2, b2, r2, c2 = after.atol, after.atol_rms, after.rtol, after.rms_share
        return Tolerance(
            a1 + a2 + max(b2 + r2, c2) * a1,
            r1 + r2 + r1 * r2,
            self.allow_nan and after.allow_nan,
            b1 + b2 * (1 + b1 + r1) + r2 * b1,
            c1 + c2 * (1 + c1) if self.rms_rtol or after.rms_rtol else 0.0,
            self.int8_rounding or after.int8_rounding,
            after.weight_bits if after.int8_rounding else self.weight_bits,
        )


@dataclass(frozen=True)
class Rounding:
    """How far the module run with a lossy variant's rounding (``runtimes.int8_rounding``)
    is from the module itself on one output and case: the error's root mean square and its
    largest element, over the elements finite on both sides. A graph rounding as the variant
    does strays about as far; the pass rule allows ``ROUNDING_FACTOR`` times that."""

    rms: float = 0.0
    max: float = 0.0
    #: int4's (simulated to float32 noise on a CPU): the widest its activations' near ties
    #: move the output (``INT4_TIES``), and the simulated module's output itself.
    ties: float = 0.0
    values: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: Why the module could not run with that rounding ('' where it ran): the room is then
    #: zero, the output judged by the shares of the rms alone, and a failure says why.
    unsimulated: str = ""
    #: Read from a golden file (data, from anywhere), not run here from the module.
    recorded: bool = field(default=False, compare=False)

    def widest(self, other: Rounding) -> Rounding:
        """The larger of the two on each measure; unsimulated (the first one's reason) only
        where neither ran: a decode step's failure keeps saying why."""
        reason = self.unsimulated if self.unsimulated and other.unsimulated else ""
        values = self.values if self.values is not None else other.values
        widest = (max(self.rms, other.rms), max(self.max, other.max), max(self.ties, other.ties))
        return Rounding(*widest, values, reason, self.recorded or other.recorded)

    @classmethod
    def between(cls, exact: np.ndarray, rounded: np.ndarray) -> Rounding:
        """The rms and the largest of |rounded - exact| where both are finite; none for
        other values."""
        if exact.shape != rounded.shape or exact.dtype.kind != "f":
            return cls()
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(rounded.astype(np.float64) - exact.astype(np.float64))
        finite = diff[np.isfinite(diff)]
        return cls(float(np.sqrt(np.mean(finite**2))), float(finite.max())) if finite.size else cls()
