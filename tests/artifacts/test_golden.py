"""Golden files keep what verify --golden judges by, as the build measured it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attn_export.artifacts.golden import GoldenCase, read_golden, write_golden
from attn_export.errors import ArtifactError
from attn_export.model_spec import Rounding

WHY = "fp16's simulation could not run (RuntimeError: no float16 kernel)"


OUT = np.arange(6, dtype=np.float32).reshape(2, 3)


def _case(**int8: Rounding) -> GoldenCase:
    return GoldenCase("distinct", {"batch": 2}, {"x": np.ones((2, 3), np.float32)}, {"o": OUT}, {}, dict(int8))


def test_a_rounding_that_could_not_run_keeps_its_reason(tmp_path: Path) -> None:
    """A golden file kept the rounding's zero room but not why it was zero: verify --golden
    judged by the shares of the rms alone without saying so, where a live verify says why."""
    path = tmp_path / "m.golden.npz"
    write_golden(path, [_case(**{"fp16:o": Rounding(unsimulated=WHY), "o": Rounding(0.25, 1.5)})])
    (case,) = read_golden(path)
    assert case.int8 == {"fp16:o": Rounding(unsimulated=WHY), "o": Rounding(0.25, 1.5)}
    long = f"{WHY}\tand then ü" + "x" * 2000  # what is written is what the reader takes back
    write_golden(path, [_case(**{"fp16:o": Rounding(unsimulated=long)})])
    (case,) = read_golden(path)
    assert case.int8["fp16:o"].unsimulated == f"{WHY} and then ü" + "x" * (1000 - len(WHY) - 12)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("distinct/unsimulated/fp16:o", np.frombuffer(b"two\nlines", np.uint8), "is not a reason"),
        ("distinct/unsimulated/fp16:o", np.frombuffer(b"x" * 1001, np.uint8), "is not a reason"),
        ("distinct/unsimulated/fp16:o", np.frombuffer(b"\xff\xfe", np.uint8), "is not a reason"),
        ("distinct/unsimulated/fp16:o", np.zeros(3, np.float32), "is not a reason"),
        ("distinct/unsimulated/int4:o", np.frombuffer(WHY.encode(), np.uint8), "belongs to no rounding the case"),
        ("distinct/simulated/int4:o", OUT, "belongs to no rounding the case"),
        ("distinct/simulated/fp16:o", OUT, "names no float output as int4:<output>"),
    ],
)
def test_a_reason_that_is_not_one_line_of_a_recorded_rounding_is_refused(
    tmp_path: Path, key: str, value: np.ndarray, message: str
) -> None:
    path = tmp_path / "m.golden.npz"
    write_golden(path, [_case(**{"fp16:o": Rounding(unsimulated=WHY)})])
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays[key] = value
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(ArtifactError, match=f"^{path}: entry '{key}' {message}"):
        read_golden(path)


def test_int4s_simulated_values_and_ties_come_back_as_written(tmp_path: Path) -> None:
    """A CPU's int4 graph is judged against the simulated module's values, within what its
    near ties move them: golden mode judges by the build's, so both are recorded."""
    path = tmp_path / "m.golden.npz"
    write_golden(path, [_case(**{"int4:o": Rounding(0.25, 1.5, 0.003, OUT + 1)})])
    (case,) = read_golden(path)
    (rounding,) = case.int8.values()
    assert (rounding.rms, rounding.max, rounding.ties) == (0.25, 1.5, 0.003)
    assert rounding.values is not None and np.array_equal(rounding.values, OUT + 1)
    assert rounding.recorded  # data: int4's own room of the module bounds what it lets pass (judge_value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (OUT.T.copy(), r"has shape \[3, 2\] of float32, expected \[2, 3\] of float32 as its output"),
        (OUT.astype(np.float64), r"has shape \[2, 3\] of float64, expected \[2, 3\] of float32 as its output"),
        (np.full((2, 3), np.nan, np.float32), "is not finite where its output is: not a simulation"),
    ],
)
def test_a_simulated_value_unlike_its_output_is_refused(tmp_path: Path, value: np.ndarray, message: str) -> None:
    path = tmp_path / "m.golden.npz"
    write_golden(path, [_case(**{"int4:o": Rounding(0.25, 1.5, 0.003, OUT)})])
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["distinct/simulated/int4:o"] = value
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(ArtifactError, match=f"entry 'distinct/simulated/int4:o' {message}"):
        read_golden(path)


def test_a_golden_file_an_older_version_wrote_says_to_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "m.golden.npz"
    write_golden(path, [_case(o=Rounding(0.25, 1.5))])
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["distinct/int8/o"] = arrays["distinct/int8/o"][:2]  # format 5: the rms and the largest element
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(
        ArtifactError, match="an older attn-export wrote this golden file; rebuild it with attn-export build"
    ):
        read_golden(path)
