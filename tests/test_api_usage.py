"""The Python API holds the CLI's standard: every bad argument is a UsageError with one
line naming the option (by the API's parameter, never a CLI flag), raised before anything
is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attn_export
from attn_export.errors import OptionError, UsageError
from tests.conftest import Built, tiny_spec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"opset": 99}, "opset 99: give 7 to 30"),
        ({"exporter": "onnxruntime"}, "exporter onnxruntime: choose dynamo or torchscript"),
        ({"provider": "gpu"}, "unknown provider gpu (known: cpu, cuda)"),
        ({"variants": ("fp64",)}, "unknown variant fp64"),
    ],
)
def test_a_bad_build_argument_is_a_usage_error_and_writes_nothing(tmp_path: Path, kwargs: dict, message: str) -> None:
    spec = tiny_spec(tmp_path / "models")
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        attn_export.build(spec, out=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"atol": -1.0}, "atol -1.0: give a finite number >= 0"),
        ({"rtol": float("nan")}, "rtol nan: give a finite number >= 0"),
        ({"seed": -1}, "seed -1: a seed is 0 or more"),
        ({"n_random": 1000}, "n_random 1000: give 0 to 100"),
        ({"providers": ("gpu",)}, "unknown provider gpu"),
        ({"runtimes": ("tensorrt",)}, "unknown runtime tensorrt"),
    ],
)
def test_a_bad_verify_argument_is_a_usage_error(shared_tiny: Built, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        attn_export.verify(shared_tiny.out, models=shared_tiny.models, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "int8"}, "variant needs spec: a built graph's manifest names its own variant"),
        (
            {"golden": True, "shapes": [{"batch": 1}]},
            "shapes and distributions cannot be combined with golden (golden files fix their cases)",
        ),
    ],
)
def test_options_that_cannot_go_together_are_refused_in_the_apis_words(
    shared_tiny: Built, kwargs: dict, message: str
) -> None:
    """The rules the CLI held alone hold for the API too, each option named as the API names it."""
    with pytest.raises(OptionError) as refused:
        attn_export.verify(shared_tiny.out, models=shared_tiny.models, **kwargs)
    assert str(refused.value) == message


def test_an_out_folder_holding_a_spec_is_refused_by_the_apis_name(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path / "models")
    with pytest.raises(OptionError, match="^" + re.escape(f"out {tmp_path / 'models'} holds the spec {spec}:")):
        attn_export.build(spec, out=tmp_path / "models")


def _tiny_module() -> object:
    from attn_export.zoo.seed import MultiHeadAttention

    return MultiHeadAttention(hidden_dim=16, num_heads=2)


SHAPES = {"query": ["batch", "seq", 16], "keys": ["batch", "kv_seq", 16], "values": ["batch", "kv_seq", 16]}
RANGES = {"batch": (1, 2), "seq": (1, 4), "kv_seq": (1, 4)}
BAD_RANGE = "give (min, max), {'min': .., 'max': ..} or a sum such as 'past_seq + seq'"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"specs": None}, "specs: give a path or a list of paths, not None"),  # TypeError
        ({"out": None}, "out: give a path, not None"),
        ({"opset": "18"}, "opset: give an integer, not '18'"),
        ({"max_memory": [1]}, 'max_memory: give bytes or a size such as "8GiB", not [1]'),
    ],
)
def test_a_build_argument_of_the_wrong_type_is_a_usage_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    """Each was a raw TypeError from code that assumed the argument's type."""
    args = {"specs": tiny_spec(tmp_path / "models"), "out": tmp_path / "out", **kwargs}
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.build(**args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "0"}, "seed: give an integer, not '0'"),  # TypeError
        ({"atol": "1e-3"}, "atol: give a number, not '1e-3'"),
        ({"jobs": "2"}, "jobs: give a number of jobs, not '2'"),
        ({"shapes": ["batch=1"]}, "shapes[0]: give a mapping of each name to a size, not 'batch=1'"),  # ValueError
        ({"shapes": [{"batch": "1"}]}, "shapes[0]['batch']: give a size, not '1'"),
        ({"providers": [1]}, "providers[0]: give a name, not 1"),
    ],
)
def test_a_verify_argument_of_the_wrong_type_is_a_usage_error(shared_tiny: Built, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.verify(shared_tiny.out, models=shared_tiny.models, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"module": None}, "module: give a torch.nn.Module, not None"),  # AttributeError
        ({"inputs": {}}, "inputs: give at least one"),  # IndexError
        ({"inputs": [["batch"]]}, "inputs: give a mapping of each name to its shape or table, not [['batch']]"),
        ({"inputs": {**SHAPES, "query": 16}}, "inputs['query']: give a shape (sizes and dim names) or a table, not 16"),
        ({"dims": {**RANGES, "batch": {"min": 1}}}, f"dims['batch']: {BAD_RANGE}, not {{'min': 1}}"),  # KeyError
        ({"dims": {**RANGES, "batch": ()}}, f"dims['batch']: {BAD_RANGE}, not ()"),  # ValueError
        ({"call": ["scale"]}, "call: give a mapping of each name to its value, not ['scale']"),
    ],
)
def test_an_export_argument_of_the_wrong_type_is_a_usage_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"module": _tiny_module(), "inputs": SHAPES, "dims": RANGES, "path": tmp_path / "m.onnx", **kwargs}
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.export(**args)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": 3}, "path: give a path, not 3"),
        ({"dims": None}, "dims: give a mapping of each name to its range, not None"),  # AttributeError
        ({"inputs": {"query": "padding"}}, "inputs['query']: give a table of keys to add, as a spec's entry has"),
        ({"seed": "0"}, "seed: give an integer, not '0'"),  # TypeError deep in the sweep
    ],
)
def test_an_assert_onnx_matches_argument_of_the_wrong_type_is_a_usage_error(
    shared_tiny: Built, kwargs: dict, message: str
) -> None:
    args = {"module": _tiny_module(), "path": shared_tiny.out / "tiny.onnx", "dims": RANGES, **kwargs}
    with pytest.raises(UsageError, match=re.escape(message)):
        attn_export.assert_onnx_matches(**args)
