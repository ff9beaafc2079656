"""Golden files keep what verify --golden judges by, as the build measured it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attn_export.artifacts.golden import GoldenCase, read_golden, write_golden
from attn_export.errors import ArtifactError
from attn_export.model_spec import Rounding

WHY = "fp16's simulation could not run (RuntimeError: no float16 kernel)"


def _case(**int8: Rounding) -> GoldenCase:
    return GoldenCase("distinct", {"batch": 2}, {"x": np.ones((2, 3), np.float32)}, {}, {}, dict(int8))


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
        ("distinct/unsimulated/int4:o", np.frombuffer(WHY.encode(), np.uint8), "says why no rounding it records ran"),
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
