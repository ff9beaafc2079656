"""The Python API holds the CLI's standard: every bad argument is a UsageError with one
line naming the option, raised before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attn_export
from attn_export.errors import UsageError
from tests.conftest import Built, tiny_spec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"opset": 99}, "--opset 99: give 7 to 30"),
        ({"exporter": "onnxruntime"}, "--exporter onnxruntime: choose dynamo or torchscript"),
        ({"provider": "gpu"}, "unknown provider gpu (known: cpu, cuda)"),
        ({"variants": ("fp64",)}, "unknown variant fp64"),
    ],
)
def test_a_bad_build_argument_is_a_usage_error_and_writes_nothing(tmp_path: Path, kwargs: dict, message: str) -> None:
    spec = tiny_spec(tmp_path / "models")
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.build(spec, out=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"atol": -1.0}, "--atol -1.0: give a finite number >= 0"),
        ({"rtol": float("nan")}, "--rtol nan: give a finite number >= 0"),
        ({"seed": -1}, "--seed -1: a seed is 0 or more"),
        ({"n_random": 1000}, "--random 1000: give 0 to 100"),
        ({"providers": ("gpu",)}, "unknown provider gpu"),
        ({"runtimes": ("tensorrt",)}, "unknown runtime tensorrt"),
    ],
)
def test_a_bad_verify_argument_is_a_usage_error(shared_tiny: Built, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.verify(shared_tiny.out, models=shared_tiny.models, **kwargs)
