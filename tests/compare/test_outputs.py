"""The comparison measures honestly: NaN never passes, shapes and dtypes must match exactly."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attn_export.compare import OutputComparison, compare_output
from attn_export.compare.outputs import judge_value
from attn_export.model_spec import Rounding, Tolerance
from attn_export.model_spec.variants import FP16_TOLERANCE
from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
from attn_export.runtimes import Target

TOL = Tolerance(1e-5, 1e-4)


def test_identical_outputs_pass_with_zero_error() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    c = compare_output("o", a, a.copy(), TOL)
    assert c.passed and c.max_abs_error == 0 and c.min_passing_atol == 0 and c.reason() == ""


def test_pass_rule_is_atol_plus_rtol_times_expected() -> None:
    expected = np.array([1.0, 100.0], dtype=np.float32)
    inside = expected + np.array([1e-5 + 1e-4 * 1.0, 1e-5 + 1e-4 * 100.0], dtype=np.float32) * 0.99
    outside = expected + np.array([0.0, 1e-5 + 1e-4 * 100.0], dtype=np.float32) * 1.5
    assert compare_output("o", expected, inside, TOL).passed
    c = compare_output("o", expected, outside, TOL)
    assert not c.passed and c.mismatched == 1 and c.worst_index == [1]
    assert math.isclose(c.min_passing_atol, c.max_abs_error - 1e-4 * 100.0, rel_tol=1e-6)


def test_relative_error_is_measured_only_where_expected_exceeds_atol() -> None:
    expected = np.array([1e-30, 2.0], dtype=np.float32)
    actual = np.array([1e-6, 2.0002], dtype=np.float32)
    c = compare_output("o", expected, actual, TOL)
    assert c.passed and c.max_rel_error is not None and math.isclose(c.max_rel_error, 1e-4, rel_tol=1e-3)
    c = compare_output("o", np.full(3, 1e-6, np.float32), np.full(3, 0.5, np.float32), TOL)
    assert not c.passed and c.max_rel_error is None  # no element to measure it on: "-", not 0


def test_integers_compare_exactly_and_say_by_how_much() -> None:
    """An integer node one off (a position capped at 16 where PyTorch has 17) once read as an
    infinite error."""
    c = compare_output("pos", np.array([[15, 17]]), np.array([[15, 16]]), TOL)
    assert not c.passed and c.max_abs_error == 1 and c.worst_index == [0, 1]
    assert c.reason() == "pos: 1/2 elements differ (integers compare exactly); max abs 1 at [0, 1]"
    big = np.array([2**60, -(2**63), 2**53], dtype=np.int64)
    c = compare_output("pos", big, big + np.array([1, 1, 1]), TOL)  # one apart, where float64 sees no difference
    assert c.mismatched == 3 and c.max_abs_error >= 1


def test_nan_where_expected_is_finite_always_fails_and_says_where() -> None:
    expected = np.zeros((2, 3), dtype=np.float32)
    actual = expected.copy()
    actual[1, 2] = np.nan
    c = compare_output("o", expected, actual, Tolerance(1e9, 1e9))
    assert not c.passed and c.unexpected_nonfinite == 1 and c.worst_index == [1, 2]
    assert c.reason() == "o: 1 NaN/Inf where expected is finite, first at [1, 2]"
    assert c.min_passing_atol == math.inf


def test_inf_where_expected_is_finite_fails() -> None:
    c = compare_output("o", np.ones(3, np.float32), np.array([1, np.inf, 1], np.float32), TOL)
    assert not c.passed and c.unexpected_nonfinite == 1


def test_matching_infinities_are_no_numbers_and_fail_unless_allowed_like_nan() -> None:
    e = np.array([-np.inf, np.inf, 1.0], np.float32)
    c = compare_output("o", e, e.copy(), TOL)
    assert not c.passed and c.shared_inf == 2 and c.mismatched == 0 and c.worst_index == [0]
    assert c.reason() == (
        "o: 2/3 elements Inf on both sides, first at [0] (set [tolerance] allow_nan = true in the spec "
        "if that is expected)"
    )
    assert compare_output("o", e, e.copy(), Tolerance(1e-5, 1e-4, allow_nan=True)).passed
    assert not compare_output("o", e, np.array([np.inf, np.inf, 1.0], np.float32), TOL).passed


def test_a_finite_value_where_expected_is_infinite_has_an_infinite_error() -> None:
    """A masked score PyTorch leaves at -inf and a graph fills with a number: before, the
    report said "max abs 0" beside the elements it failed."""
    c = compare_output("o", np.array([1.0, 2.0, -np.inf], np.float32), np.array([1.0, 2.5, 7.0], np.float32), TOL)
    assert not c.passed and c.mismatched == 2
    assert c.max_abs_error == math.inf and c.min_passing_atol == math.inf and c.worst_index == [2]


def test_a_case_that_compared_no_element_proves_nothing() -> None:
    """Every element left out proves nothing; outputs empty at a size the spec allows (min = 0)
    prove their shapes, which is all there is (such a spec built, and verify failed it for good)."""
    e = np.ones((2, 4), np.float32)
    case = CaseResult("m", Target("onnxruntime", "cpu"), "min", {}, 0, "torch[cpu]")
    case.comparisons = [dataclasses.replace(compare_output("o", e, e.copy(), TOL), total=0)]  # as fully_masked leaves
    assert not case.passed
    assert case.reasons() == [
        'compared no element: every element is one the spec leaves out (fully_masked = "ignore"), which proves nothing'
    ]
    empty = np.zeros((0, 4), np.float32)
    case.comparisons = [compare_output("o", empty, empty.copy(), TOL)]
    assert case.passed and case.reasons() == []
    case.comparisons = [compare_output("o", empty, np.zeros((0, 5), np.float32), TOL)]
    assert not case.passed
    assert not VerifyReport("out", 0, {}, [ModelCheck("m", "m.onnx")], []).passed  # no case at all


def test_nan_on_both_sides_is_counted_and_fails_unless_allowed() -> None:
    e = np.array([[1.0, np.nan], [np.nan, 2.0]], np.float32)
    c = compare_output("o", e, e.copy(), TOL)
    assert not c.passed and c.shared_nan == 2 and c.mismatched == 0 and c.worst_index == [0, 1]
    assert c.reason() == (
        "o: 2/4 elements NaN on both sides, first at [0, 1] (set [tolerance] allow_nan = true in the spec "
        "if that is expected)"
    )
    allow = Tolerance(1e-5, 1e-4, allow_nan=True)
    allowed = compare_output("o", e, e.copy(), allow)
    assert allowed.passed and allowed.shared_nan == 2 and allowed.reason() == ""
    assert OutputComparison.from_dict(allowed.to_dict()) == allowed
    assert not compare_output("o", e, np.array([[1, np.nan], [0, 2]], np.float32), allow).passed  # NaN vs finite


def test_shape_and_dtype_must_match_exactly() -> None:
    a = np.zeros((2, 3), np.float32)
    assert compare_output("o", a, np.zeros((3, 2), np.float32), TOL).reason() == "o: shape [3, 2] != expected [2, 3]"
    assert compare_output("o", a, np.zeros((2, 3), np.float64), TOL).reason() == "o: dtype float64 != expected float32"
    assert compare_output("o", a, None, TOL).reason() == "o: output missing"


def test_a_case_whose_rounding_could_not_be_simulated_says_so_when_it_fails() -> None:
    """Without its simulated rounding a case has the shares of the rms alone, and a user
    reading its red must see why (the rounding's ``unsimulated``, from ``TorchRuntime``)."""
    expected = np.linspace(-1, 1, 8, dtype=np.float32)
    why = "fp16's simulation could not run (RuntimeError: no float16 kernel)"
    c = judge_value("o", expected, expected + 0.1, FP16_TOLERANCE, rounding=Rounding(unsimulated=why))
    assert not c.passed and c.unsimulated == why
    assert c.reason().endswith(f"; {why}: judged by the shares of the rms alone")
    ran = judge_value("o", expected, expected + 0.1, FP16_TOLERANCE, rounding=Rounding(1e-3, 1e-3))
    assert not ran.passed and "shares of the rms alone" not in ran.reason()
    assert OutputComparison.from_dict(c.to_dict()) == c


def test_no_rounding_room_passes_an_overflowed_graph() -> None:
    """On a GPU a float16 MatMul overflows where ONNX Runtime's CPU (and so the simulation)
    stays finite: the graph's Inf/NaN fails whatever room fp16's rounding gives."""
    expected = np.linspace(-1, 1, 8, dtype=np.float32)
    actual = expected.copy()
    actual[3] = np.nan
    c = judge_value("o", expected, actual, FP16_TOLERANCE, rounding=Rounding(1.0, 1.0))
    assert not c.passed and c.unexpected_nonfinite == 1


def test_a_rounding_that_moves_an_element_past_the_outputs_largest_still_gives_its_room() -> None:
    """int4's rounding of large cached values moved a two-layer Llama's logit by 0.634 where
    the largest logit was 0.54; a graph rounding as the simulation does (to 2e-7) is right.
    The room stops at twice the largest element, so a graph off by more still fails."""
    from attn_export.model_spec.variants import INT4_TOLERANCE

    rng = np.random.default_rng(0)
    expected = rng.uniform(-0.5, 0.5, 4096).astype(np.float32)
    expected[7] = 0.54
    drift = rng.normal(0, 0.05, 4096).astype(np.float32)
    drift[11] = 0.634
    rounding = Rounding.between(expected, expected + drift)
    right = judge_value("logits", expected, expected + drift, INT4_TOLERANCE, rounding=rounding)
    assert right.passed, right.reason()
    wrong = drift.copy()
    wrong[11] = 1.2  # more than twice the largest element
    assert not judge_value("logits", expected, expected + wrong, INT4_TOLERANCE, rounding=rounding).passed


def test_int4_on_a_cpu_is_judged_against_its_simulation_within_its_ties() -> None:
    """Where the tolerance asks (``Tolerance.simulated``: int4 on ONNX Runtime's CPU), the
    graph is held to the simulated module's values at the model's own tolerance plus twice
    what near ties move them: a drift 1 % of the rounding passes int4's own room and fails
    here; the graph that gives the simulation passes; left-out elements count neither way;
    without the simulated values the variant's own room judges."""
    from attn_export.model_spec.variants import INT4_TOLERANCE

    rng = np.random.default_rng(0)
    exact = rng.normal(0, 1, 512).astype(np.float32)
    simulated = exact + rng.normal(0, 0.05, 512).astype(np.float32)
    tol = dataclasses.replace(INT4_TOLERANCE, simulated=Tolerance(1e-5, 1e-4))
    rounding = dataclasses.replace(Rounding.between(exact, simulated), ties=1e-3, values=simulated)
    off = simulated + 0.01 * (simulated - exact) + 2.5e-3
    assert judge_value("o", exact, off, INT4_TOLERANCE, rounding=rounding).passed  # int4's own room holds it
    wrong = judge_value("o", exact, off, tol, rounding=rounding)
    assert not wrong.passed and wrong.simulated == "int4" and wrong.atol == pytest.approx(1e-5 + 2e-3)
    assert (
        "; against int4's simulation, which a right graph gives to float32 noise (near ties move it 0.001; int4 "
        "moves it "
    ) in wrong.reason()
    assert wrong.within_own_room and wrong.reason().endswith(
        "; within int4's own room of the float module: a fault below int4's rounding, or a MatMul rounded on one "
        "side only"
    )
    far = judge_value("o", exact, -simulated, tol, rounding=rounding)
    assert not far.passed and not far.within_own_room and "own room" not in far.reason()
    assert judge_value("o", exact, simulated + 1.9e-3, tol, rounding=rounding).passed
    left_out = np.zeros(512, bool)
    left_out[:256] = True
    blanked = np.where(left_out, 0, off).astype(np.float32)
    kept = judge_value("o", np.where(left_out, 0, exact), blanked, tol, left_out=left_out, rounding=rounding)
    assert not kept.passed and kept.mismatched <= 256 and kept.worst_index is not None and kept.worst_index[0] >= 256
    # a golden file is data: whatever it records, the module's own values bound the verdict
    forged = dataclasses.replace(rounding, ties=1e6, recorded=True)
    assert not judge_value("o", exact, -exact, tol, rounding=forged).passed
    zeros = dataclasses.replace(rounding, values=np.zeros_like(exact), recorded=True)
    assert not judge_value("o", exact, np.zeros_like(exact), tol, rounding=zeros).passed
    # a simulation run here is the module's own: where int4's rounding strays past its capped
    # room (a Qwen3's logits on large values, 0.76 x their rms), the graph giving it is right
    coarse = exact + rng.normal(0, 0.8, 512).astype(np.float32)
    live = dataclasses.replace(Rounding.between(exact, coarse), values=coarse)
    assert judge_value("o", exact, coarse, tol, rounding=live).passed
    assert not judge_value("o", exact, coarse, tol, rounding=dataclasses.replace(live, recorded=True)).passed
    # the model's own atol_rms holds against the simulation as against the module
    shared = dataclasses.replace(tol, simulated=Tolerance(1e-5, 1e-4, atol_rms=0.1))
    assert judge_value("o", exact, simulated + 0.02, shared, rounding=rounding).passed
    unsimulated = dataclasses.replace(rounding, values=None)
    absent = judge_value("o", exact, off, tol, rounding=unsimulated)
    assert absent.passed and absent.not_simulated.startswith("int4's simulated values are absent (")
    unlike = dataclasses.replace(rounding, values=simulated[:256])
    assert judge_value("o", exact, off, tol, rounding=unlike).not_simulated == (
        "int4's simulated values are [256], the output [512]"
    )
    failed = judge_value("o", exact, -exact, tol, rounding=unsimulated)
    assert failed.reason().endswith(
        "(a run with its activation codes nudged failed, or the golden file holds none)"
        ": judged at int4's own room of the float module"
    )
    assert not judge_value("o", exact, off, INT4_TOLERANCE, rounding=unsimulated).not_simulated  # not asked for
    ids = np.arange(4)  # an integer output compares exactly: it has no simulated values to miss
    assert not judge_value("i", ids, ids, tol, rounding=Rounding()).not_simulated
    assert OutputComparison.from_dict(wrong.to_dict()) == wrong


def test_a_decode_steps_widest_rounding_keeps_why_none_ran() -> None:
    """A trajectory's rounding is the widest of its steps': where none ran, the reason stays."""
    why = "int4's simulation could not run (RuntimeError: x)"
    assert Rounding(unsimulated=why).widest(Rounding(unsimulated="other")).unsimulated == why
    assert Rounding(unsimulated=why).widest(Rounding(0.1, 0.2)).unsimulated == ""


def test_round_trips_through_dict() -> None:
    c = compare_output("o", np.ones(4, np.float32), np.array([1, 2, 1, 1], np.float32), TOL)
    assert OutputComparison.from_dict(c.to_dict()) == c


@settings(max_examples=60, deadline=None)
@given(
    expected=hnp.arrays(
        np.float32, hnp.array_shapes(min_dims=1, max_dims=4, max_side=6), elements=st.floats(-1e3, 1e3, width=32)
    ),
    noise=st.floats(0, 1e-2),
    atol=st.floats(0, 1e-2),
    rtol=st.floats(0, 1e-2),
)
def test_property_verdict_matches_the_rule_elementwise(expected, noise, atol, rtol) -> None:
    rng = np.random.default_rng(0)
    actual = (expected + rng.uniform(-noise, noise, expected.shape)).astype(np.float32)
    c = compare_output("o", expected, actual, Tolerance(atol, rtol))
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    within = diff <= atol + rtol * np.abs(expected.astype(np.float64))
    assert c.passed == bool(within.all())
    assert c.mismatched == int((~within).sum())
    assert c.max_abs_error == float(diff.max())
    # the reported smallest passing atol really passes at this rtol
    assert compare_output("o", expected, actual, Tolerance(c.min_passing_atol * (1 + 1e-9) + 1e-30, rtol)).passed
