"""Measure how one runtime's outputs differ from the expected ones, output by output.

The numbers are data; the one pass rule (``output_passed``) judges them, here and nowhere
else. A NaN or Inf where the expected value is finite is counted, so is a NaN on both
sides, and mismatched shapes or dtypes are recorded before any number is compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attn_export.artifacts.json_fields import json_record
from attn_export.model_spec import Rounding, Tolerance
from attn_export.model_spec.tolerance import rounding_name
from attn_export.runtimes.int8_rounding import INT4_TIE_FACTOR

__all__ = [
    "FLOOR_FACTOR",
    "FLOAT16_ROUNDING_CAP",
    "FLOAT16_ROUNDING_FACTOR",
    "ROUNDING_FACTOR",
    "OutputComparison",
    "allowed_error",
    "case_tolerance",
    "compare_output",
    "compare_outputs",
    "judge_value",
    "output_passed",
    "rms_of",
    "rounding_factor",
]

#: A graph may differ from PyTorch by this many times PyTorch's own float32 error.
FLOOR_FACTOR = 10.0
#: An int8 graph may stray from PyTorch by this many times what int8 rounding, applied to
#: the module in PyTorch (``runtimes.int8_rounding``), does there (``Tolerance.int8_rounding``),
#: where that is more than the shares of the rms allow. The simulation gives ONNX Runtime's
#: int8 graphs' outputs to float32 noise on the zoo (their errors' ratio 1.00 on every
#: model); a quarter more leaves room for a module it reproduces less well.
ROUNDING_FACTOR = 1.25
#: fp16's simulation (``runtimes.int8_rounding.in_float16``) rounds op by op as PyTorch's
#: kernels do, not as ONNX Runtime's (which runs some float16 ops in float32 on a CPU): on
#: the tiny zoo a right fp16 graph strayed up to 1.7 x it off near ties, so twice it.
FLOAT16_ROUNDING_FACTOR = 2.0


def rounding_factor(tol: Tolerance) -> float:
    """How many times its simulated rounding a graph judged by ``tol`` may stray."""
    return FLOAT16_ROUNDING_FACTOR if tol.weight_bits == 16 else ROUNDING_FACTOR


#: The most room a rounding gives the error's rms, as a share of the output's: a golden file
#: is data, and whatever it records, an output of zeros or of the wrong sign fails.
ROUNDING_CAP = 0.75
#: The most room a rounding gives one element, in the value's largest elements: int4's
#: rounding of large cached values moved a two-layer Llama's logits by up to 1.18 x their
#: largest (0.643 against 0.546), and the graph gave the simulation's values to 2e-7; at 1 x,
#: that right graph was red on large values at two seeds of three.
ELEMENT_CAP = 2.0
#: fp16's: its simulated rounding's rms stayed under 1 % of the output's on the tiny zoo
#: (large values included), where int8's reaches half of it.
FLOAT16_ROUNDING_CAP = 0.1


#: What a failure's "against int4's simulation" clause means (``OutputComparison._against``),
#: for a report to say once.
SIMULATED_CLAUSE = (
    "'against int4's simulation': on a CPU, an int4 graph is judged against the module run with int4's rounding "
    "simulated, which a right graph gives to float32 noise, within twice how far near ties of its activations' "
    "codes move it; 'within int4's own room of the float module': the looser rule against the float module would "
    "hold it: a fault smaller than int4's rounding, a MatMul the simulation does not round (a weight the module "
    "computes, code under a function of its own), or one the graph leaves in float32 that it rounds (a weight the "
    "graph computes from a constant: count the MatMulNBits)"
)


def case_tolerance(tol: Tolerance, floor: float, rms: float = 0.0, rounding: Rounding | None = None) -> Tolerance:
    """The output's tolerance on one case, its ``atol_rms`` taken of the expected value's
    root mean square ``rms`` there and widened by ``FLOOR_FACTOR`` x PyTorch's own float32
    error: large-magnitude inputs are judged by what float32 can do, and a graph wrong only
    for large values still fails (its error is far above the floor). Where ``ROUNDING_FACTOR``
    x the worst element of the variant's simulated ``rounding`` is more than that share of
    the rms, it takes the share's place: the larger of the two, never their sum, so a case
    where int8 loses little is judged as tightly as before."""
    share = tol.atol_rms * rms
    if rounding is not None and tol.int8_rounding:
        share = max(share, rounding_factor(tol) * rounding.max)
    return dataclasses.replace(tol, atol=tol.atol + FLOOR_FACTOR * floor + share, atol_rms=0.0)


def rms_of(expected: np.ndarray, kept: np.ndarray | None = None) -> float:
    """The root mean square of a float value's finite elements, of those ``kept`` alone where
    given (0 for other values): the scale ``Tolerance.atol_rms`` is a share of."""
    if expected.dtype.kind != "f" or expected.size == 0:
        return 0.0
    chosen = np.isfinite(expected) if kept is None else np.isfinite(expected) & kept
    values = expected[chosen].astype(np.float64)
    return float(np.sqrt(np.mean(values**2))) if values.size else 0.0


def judge_value(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray | None,
    tol: Tolerance,
    floor: float = 0.0,
    left_out: np.ndarray | None = None,
    rounding: Rounding | None = None,
) -> OutputComparison:
    """One value against its expected one at ``tol`` on this case: atol widened by the floor
    and the rms share, and the error's rms bounded where ``rms_rtol`` is set; both rms taken
    over the same elements, the finite ones on both sides not ``left_out`` (elements a spec
    leaves out count neither way). For int8 (``Tolerance.int8_rounding``) each share is at
    least ``ROUNDING_FACTOR`` x what the simulated ``rounding`` does there, that room no
    larger than the value's largest element per element and ``ROUNDING_CAP`` of its rms on
    the rms (``FLOAT16_ROUNDING_CAP`` for fp16): a recorded rounding comes from a build
    folder, which is data."""
    kept = None if left_out is None or left_out.shape != expected.shape else ~left_out
    rms = rms_of(expected, kept)
    simulated = rounding.values if rounding is not None else None
    if tol.simulated is not None and simulated is not None and simulated.shape == expected.shape:
        assert rounding is not None
        judged = _against_simulation(name, expected, actual, tol.simulated, floor, kept, rounding, simulated)
        own = judge_value(name, expected, actual, dataclasses.replace(tol, simulated=None), floor, left_out, rounding)
        if judged.passed:  # a recorded simulation is data: the variant's own room of the module holds besides
            return own if rounding.recorded and not own.passed else judged
        return dataclasses.replace(judged, within_own_room=own.passed)
    if tol.simulated is not None and rounding is not None and expected.dtype.kind == "f":  # absent: say so
        own = judge_value(name, expected, actual, dataclasses.replace(tol, simulated=None), floor, left_out, rounding)
        return dataclasses.replace(own, not_simulated=_why_not_simulated(rounding, simulated, expected))
    factor = rounding_factor(tol)
    rounding = _capped(rounding, expected, rms, tol) if rounding is not None and tol.int8_rounding else Rounding()
    result = compare_output(name, expected, actual, case_tolerance(tol, floor, rms, rounding), kept)
    base = tol.atol + FLOOR_FACTOR * floor
    bound = base + max(tol.rms_rtol * rms, factor * rounding.rms) if tol.rms_rtol else None
    beyond_shares = result.min_passing_atol > base + tol.atol_rms * rms or (
        bound is not None and result.rms_error > base + tol.rms_rtol * rms
    )
    judged = dataclasses.replace(
        result,
        floor=floor,
        rms=rms,
        atol_rms=tol.atol_rms,
        rms_bound=bound,
        rounding_rms=rounding.rms,
        rounding_max=rounding.max,
        unsimulated=rounding.unsimulated,
    )
    return dataclasses.replace(judged, by_rounding=judged.passed and bool(rounding.max) and beyond_shares)


def _why_not_simulated(rounding: Rounding, simulated: np.ndarray | None, expected: np.ndarray) -> str:
    """Why an output whose tolerance asks for int4's simulated values (``Tolerance.simulated``)
    has none to be judged against."""
    if rounding.unsimulated:
        return rounding.unsimulated
    if simulated is None:
        return (
            f"{rounding_name(4)}'s simulated values are absent (a run with its activation codes nudged failed, "
            "or the golden file holds none)"
        )
    return f"{rounding_name(4)}'s simulated values are {list(simulated.shape)}, the output {list(expected.shape)}"


def _against_simulation(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray | None,
    exact: Tolerance,
    floor: float,
    kept: np.ndarray | None,
    rounding: Rounding,
    simulated: np.ndarray,
) -> OutputComparison:
    """A value against the module run with int4's rounding (``Rounding.values``), which a
    right graph on a CPU gives to float32 noise: at ``exact`` (the model's own tolerance)
    widened by ``FLOOR_FACTOR`` x PyTorch's float32 error and ``INT4_TIE_FACTOR`` x how far
    near ties of the activations' codes move it, that room no larger than ``ELEMENT_CAP`` x
    the value's largest element (a recorded simulation comes from a build folder, data; the
    variant's own room of the module itself holds besides, ``judge_value``). Elements not
    ``kept`` are the expected value's (blanked alike on both sides)."""
    values = simulated if kept is None else np.where(kept, simulated, expected)
    rms = rms_of(values, kept)
    finite = np.abs(values[np.isfinite(values)]) if values.dtype.kind == "f" else values[:0]
    ties = min(INT4_TIE_FACTOR * rounding.ties, ELEMENT_CAP * float(finite.max()) if finite.size else 0.0)
    base = exact.atol + FLOOR_FACTOR * floor
    atol = base + exact.atol_rms * rms + ties
    result = compare_output(name, values, actual, dataclasses.replace(exact, atol=atol, atol_rms=0.0), kept)
    return dataclasses.replace(
        result,
        floor=floor,
        rms=rms,
        atol_rms=exact.atol_rms,
        rms_bound=base + exact.rms_rtol * rms if exact.rms_rtol else None,
        rounding_rms=rounding.rms,
        rounding_max=rounding.max,
        ties=ties,
        simulated=rounding_name(4),
    )


def _capped(rounding: Rounding, expected: np.ndarray, rms: float, tol: Tolerance) -> Rounding:
    """``rounding`` so that the room it gives stays near the value: per element no larger
    than ``ELEMENT_CAP`` x its largest element, on the rms no larger than ``ROUNDING_CAP``
    (fp16: ``FLOAT16_ROUNDING_CAP``) of its rms."""
    finite = expected[np.isfinite(expected)] if expected.dtype.kind == "f" else expected[:0]
    largest = float(np.abs(finite).max()) if finite.size else 0.0
    factor = rounding_factor(tol)
    cap = FLOAT16_ROUNDING_CAP if tol.weight_bits == 16 else ROUNDING_CAP
    most = Rounding(cap * rms / factor, ELEMENT_CAP * largest / factor)
    return dataclasses.replace(rounding, rms=min(rounding.rms, most.rms), max=min(rounding.max, most.max))


def allowed_error(tol: Tolerance, expected: np.ndarray) -> np.ndarray:
    """The pass rule's bound: |actual - expected| <= atol + rtol * |expected|."""
    return tol.atol + tol.rtol * np.abs(expected)


def output_passed(c: OutputComparison) -> bool:
    """Same shape and dtype, no NaN/Inf where PyTorch is finite, no NaN (or Inf) on both
    sides unless the spec allows it, every element within bounds."""
    nan_ok = (c.shared_nan == 0 and c.shared_inf == 0) or c.allow_nan
    ok = c.shape_ok and c.dtype_ok and c.unexpected_nonfinite == 0 and nan_ok and c.mismatched == 0
    return ok and c.rms_ok


@dataclass
class OutputComparison:
    """Numbers describing how one output differs from its expected value."""

    name: str
    expected_shape: list[int]
    actual_shape: list[int]
    expected_dtype: str
    actual_dtype: str
    atol: float
    rtol: float
    #: PyTorch's own float32 error here; ``atol`` is the spec's plus ``FLOOR_FACTOR`` times it.
    floor: float = 0.0
    #: The expected value's root mean square, and the share of it ``atol`` holds
    #: (``Tolerance.atol_rms``; 0: an atol that does not scale with the values).
    rms: float = 0.0
    atol_rms: float = 0.0
    #: The error's root mean square, and the most it may be (``Tolerance.rms_rtol``: the
    #: spec's atol and the floor, plus that share of ``rms``); None where not checked.
    rms_error: float = 0.0
    rms_bound: float | None = None
    #: What the variant's rounding, applied to the module in PyTorch, does to this output
    #: here (its rms and its worst element; 0 where the tolerance does not ask): ``atol``
    #: and ``rms_bound`` hold ``ROUNDING_FACTOR`` times each where that is more than the shares.
    rounding_rms: float = 0.0
    rounding_max: float = 0.0
    #: Whether the error is beyond the shares of the rms alone: within what int8 rounding
    #: does to the module here, but past what a fixed share holds (verify says so).
    by_rounding: bool = False
    #: Why the variant's rounding could not be simulated here ('' where it was, or where the
    #: tolerance does not ask): the output was judged by the shares of the rms alone.
    unsimulated: str = ""
    #: The variant whose rounding, simulated in PyTorch, gave the values judged against
    #: (int4 on a CPU: a right graph gives them to float32 noise), and the room its near
    #: ties give (part of ``atol``); '' and 0 where the module's own values were.
    simulated: str = ""
    ties: float = 0.0
    #: Failed against the simulation, yet within the variant's own room against the module
    #: itself: a fault smaller than its rounding, or a MatMul the simulation does not round.
    within_own_room: bool = False
    #: Why the values the tolerance asks to judge against (``Tolerance.simulated``) were absent
    #: ('' where they were, or where it does not ask): the output was judged at the variant's
    #: own room of the float module instead, which a fault smaller than its rounding passes.
    not_simulated: str = ""
    max_abs_error: float = 0.0
    #: Largest |actual - expected| / |expected| where |expected| > atol: below atol the
    #: ratio says nothing (an expected 1e-300 would print 1e+307); None where no element is.
    max_rel_error: float | None = 0.0
    mismatched: int = 0
    total: int = 0
    #: The smallest atol that would pass at this rtol (as Polygraphy prints it).
    min_passing_atol: float = 0.0
    #: Count of NaN/Inf in the actual output where the expected value is finite.
    unexpected_nonfinite: int = 0
    #: Count of elements that are NaN on both sides (agreement, but not a number).
    shared_nan: int = 0
    #: Count of elements that are the same infinity on both sides (agreement, but no number).
    shared_inf: int = 0
    #: Whether the spec accepts NaN on both sides (``[tolerance] allow_nan``).
    allow_nan: bool = False
    #: Index of the first unexpected NaN/Inf, else of the first shared NaN, else of the worst error.
    worst_index: list[int] | None = None
    missing: bool = False

    @property
    def shape_ok(self) -> bool:
        return not self.missing and self.expected_shape == self.actual_shape

    @property
    def dtype_ok(self) -> bool:
        return not self.missing and self.expected_dtype == self.actual_dtype

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.total if self.total else 0.0

    @property
    def numeric(self) -> bool:
        """Whether numbers were compared at all (shape and dtype matched)."""
        return self.shape_ok and self.dtype_ok

    @property
    def passed(self) -> bool:
        return output_passed(self)

    @property
    def rms_ok(self) -> bool:
        """Whether the error's rms is within its bound (where one is checked)."""
        return self.rms_bound is None or not self.numeric or self.rms_error <= self.rms_bound

    def reason(self) -> str:
        """One line saying why it failed, or '' when it passed."""
        if self.missing:
            return f"{self.name}: output missing"
        if not self.shape_ok:
            return f"{self.name}: shape {self.actual_shape} != expected {self.expected_shape}"
        if not self.dtype_ok:
            return f"{self.name}: dtype {self.actual_dtype} != expected {self.expected_dtype}"
        if self.unexpected_nonfinite:
            return (
                f"{self.name}: {self.unexpected_nonfinite} NaN/Inf where expected is finite, "
                f"first at {self.worst_index}"
            )
        if (self.shared_nan or self.shared_inf) and not self.allow_nan:
            kinds = [f"{self.shared_nan}/{self.total} elements NaN"] if self.shared_nan else []
            kinds += [f"{self.shared_inf}/{self.total} elements Inf"] if self.shared_inf else []
            return (
                f"{self.name}: {' and '.join(kinds)} on both sides, first at {self.worst_index} "
                "(set [tolerance] allow_nan = true in the spec if that is expected)"
            )
        if self.mismatched and self.expected_dtype.startswith(("int", "uint", "bool")):
            return (
                f"{self.name}: {self.mismatched}/{self.total} elements differ (integers compare exactly); "
                f"max abs {self.max_abs_error:.3g} at {self.worst_index}"
            )
        if self.mismatched:
            return (
                f"{self.name}: {self.mismatched}/{self.total} elements "
                f"({100 * self.mismatch_fraction:.2f}%) outside atol={self.atol:g} rtol={self.rtol:g}; "
                f"max abs {self.max_abs_error:.3g} at {self.worst_index}, "
                f"needs atol>={self.min_passing_atol:.3g}{self._shares_alone()}{self._against()}"
            )
        if not self.rms_ok:
            assert self.rms_bound is not None
            share = f" ({self.rms_error / self.rms:.1%} of the output's rms {self.rms:.3g})" if self.rms else ""
            return (
                f"{self.name}: the error's rms {self.rms_error:.3g}{share} is over its bound {self.rms_bound:.3g} "
                "(rms_rtol): every element within atol, but the whole output off, as a wrong scale or zero "
                f"point leaves it; a right graph's rounding stays below{self._shares_alone()}{self._against()}"
            )
        return ""

    def _against(self) -> str:
        """The clause naming the simulated rounding judged against, '' where none was; what
        it means is said once per report (``SIMULATED_CLAUSE``), not on every failure."""
        if not self.simulated:
            return ""
        s, moved = self.simulated, self.ties / INT4_TIE_FACTOR
        ties = f"near ties move it {moved:.3g}" if moved else "no near tie moves it"
        own = (
            f"; within {s}'s own room of the float module: a fault below {s}'s rounding, or a MatMul rounded on "
            "one side only"
            if self.within_own_room
            else ""
        )
        return (
            f"; against {s}'s simulation, which a right graph gives to float32 noise ({ties}; {s} moves it "
            f"{self.rounding_max:.3g} from the float module){own}"
        )

    def _shares_alone(self) -> str:
        """The clause saying the variant's rounding, or the values judged against, could not be
        simulated ('' where they were)."""
        if self.unsimulated:
            return f"; {self.unsimulated}: judged by the shares of the rms alone"
        if self.not_simulated:
            return f"; {self.not_simulated}: judged at {rounding_name(4)}'s own room of the float module"
        return ""

    @property
    def widened(self) -> bool:
        """Whether PyTorch's own error, not the spec, set most of this tolerance."""
        return FLOOR_FACTOR * self.floor > self.atol - FLOOR_FACTOR * self.floor

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(passed=self.passed, mismatch_fraction=self.mismatch_fraction)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "comparison") -> OutputComparison:
        """The comparison ``to_dict`` wrote; ArtifactError naming the first field (``where.atol``)
        missing, unknown or not of its type: a comparison is read from a report from anywhere."""
        return json_record(cls, d, where, derived=("passed", "mismatch_fraction"))


def compare_output(
    name: str, expected: np.ndarray, actual: np.ndarray | None, tol: Tolerance, kept: np.ndarray | None = None
) -> OutputComparison:
    """Measure one output against its expected value at the given tolerance; the error's
    rms over the elements finite on both sides (and ``kept``, where given)."""
    if actual is None:
        return OutputComparison(
            name, list(expected.shape), [], str(expected.dtype), "", tol.atol, tol.rtol, missing=True
        )
    result = OutputComparison(
        name,
        list(expected.shape),
        list(actual.shape),
        str(expected.dtype),
        str(actual.dtype),
        tol.atol,
        tol.rtol,
        total=int(expected.size),
        allow_nan=tol.allow_nan,
    )
    if not (result.shape_ok and result.dtype_ok) or expected.size == 0:
        return result
    if expected.dtype.kind not in "fc":  # integers and booleans compare exactly, past 2**53 too
        differ = expected != actual
        result.mismatched = int(differ.sum())
        if result.mismatched:
            with np.errstate(over="ignore"):  # how far, in float64: at least 1 where they differ
                far = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
                diff = np.where(differ, np.maximum(far, 1), 0)
            result.worst_index = [int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape)]
            result.max_abs_error = float(diff.max())
            result.min_passing_atol = float("inf")
        return result

    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    e_finite = np.isfinite(e)
    # Where expected is NaN/Inf itself, the actual must be the same non-finite value.
    both_nan = np.isnan(e) & np.isnan(a)
    same_nonfinite = ~e_finite & (both_nan | (e == a))
    bad_nonfinite = e_finite & ~np.isfinite(a)
    result.unexpected_nonfinite = int(bad_nonfinite.sum())
    both_inf = np.isinf(e) & (e == a)
    result.shared_nan = int(both_nan.sum())
    result.shared_inf = int(both_inf.sum())

    both = e_finite & np.isfinite(a)
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.where(both, np.abs(a - e), 0.0)
        significant = both & (np.abs(e) > tol.atol)
        rel_err = np.where(significant, abs_err / np.where(significant, np.abs(e), 1.0), 0.0)
    allowed = allowed_error(tol, np.where(both, e, 0.0))
    within = (both & (abs_err <= allowed)) | same_nonfinite
    result.mismatched = int((~within).sum())
    result.max_abs_error = float(abs_err.max()) if abs_err.size else 0.0
    counted = both if kept is None else both & kept
    result.rms_error = float(np.sqrt(np.mean(abs_err[counted] ** 2))) if counted.any() else 0.0
    result.max_rel_error = float(rel_err.max()) if significant.any() else None
    unmatched = ~within & ~both  # -inf expected where the actual is finite: no finite error says it
    if unmatched.any():
        result.max_abs_error = result.max_rel_error = float("inf")
    if result.unexpected_nonfinite:
        result.worst_index = [int(i) for i in np.argwhere(bad_nonfinite)[0]]
        result.min_passing_atol = float("inf")
    elif unmatched.any():
        result.worst_index = [int(i) for i in np.argwhere(unmatched)[0]]
        result.min_passing_atol = float("inf")
    else:
        result.worst_index = [int(i) for i in np.unravel_index(int(np.argmax(abs_err)), abs_err.shape)]
        needed = abs_err - tol.rtol * np.abs(np.where(both, e, 0.0))
        result.min_passing_atol = float(max(needed.max(), 0.0))
        if result.mismatched and not both.all():
            result.min_passing_atol = float("inf")
        if (result.shared_nan or result.shared_inf) and not result.allow_nan:
            result.worst_index = [int(i) for i in np.argwhere(both_nan | both_inf)[0]]
    return result


def compare_outputs(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerances: Mapping[str, Tolerance],
    floors: Mapping[str, float] | None = None,
    left_out: Mapping[str, np.ndarray] | None = None,
    int8: Mapping[str, Rounding] | None = None,
) -> list[OutputComparison]:
    """Compare every expected output (``judge_value``); an output the runtime did not
    produce fails. ``floors`` (PyTorch's own float32 error per output) and, for a tolerance
    that asks, ``int8`` (what weight quantization's rounding does to the module, by
    ``Tolerance.rounding_key``: int8's and int4's) widen each tolerance
    (``compare.outputs.case_tolerance``); ``left_out`` selects elements that count in
    neither rms (the caller blanks them alike on both sides)."""
    floors, left_out, int8 = floors or {}, left_out or {}, int8 or {}
    return [
        judge_value(
            n,
            e,
            actual.get(n),
            tolerances[n],
            floors.get(n, 0.0),
            left_out.get(n),
            int8.get(tolerances[n].rounding_key(n)),
        )
        for n, e in expected.items()
    ]
