"""A replay bundle is data: replay refuses one whose files do not belong together, or that
says something it cannot mean, in one line with exit 2, and judges one that is whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from attn_export.artifacts.bundle import write_bundle
from attn_export.artifacts.golden import GoldenCase, encode_golden
from attn_export.cli import cli
from attn_export.errors import OptionError, RuntimeFailure, UsageError
from attn_export.pipelines.localize import replay_bundle


def _bundle(folder: Path, axis: int = -1, zero_row: int | None = None, rows: list[list[bool]] | None = None) -> Path:
    """A one-node region (Softmax over ``axis``) and PyTorch's softmax over the last axis:
    0 on query row ``zero_row`` of the first sequence, as PyTorch's safe softmax gives on a
    row with no key, where the spec leaves out ``rows`` (``[batch, query]``)."""
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["softmax"], axis=axis, name="node_softmax")],
        "region",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
        [onnx.ValueInfoProto(name="softmax")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    expected = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    if zero_row is not None:
        expected[0, zero_row] = 0.0
    info = {
        "model": "m",
        "fx_node": "softmax",
        "nodes": ["node_softmax"],
        "value": "softmax",
        "source": "m.py:3",
        "code": "y = x.softmax(-1)",
        "tolerance": {"atol": 1e-5, "rtol": 1e-4},
        "left_out_rows": rows,
        "localize": "attn-export localize build m",
    }
    write_bundle(folder, model.SerializeToString(), {"x": x}, {"softmax": expected.astype(np.float32)}, info)
    return folder


def _replay(folder: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["replay", str(folder), *args])
    return result.exit_code, result.output


def test_a_whole_bundle_agrees_or_differs(tmp_path: Path) -> None:
    assert _replay(_bundle(tmp_path / "right"))[0] == 0
    code, output = _replay(_bundle(tmp_path / "wrong", axis=1))
    assert code == 1 and output.splitlines()[1].startswith("DIFFERS: softmax: ")


def test_the_padded_rows_localize_left_out_are_left_out_of_the_replay(tmp_path: Path) -> None:
    """Replay judged every row: a region right on every row the spec judges failed on a
    padded one (the graph's softmax where PyTorch gives 0), and still would once fixed."""
    padded = [[False, False, True], [False, False, False]]
    assert _replay(_bundle(tmp_path / "left-out", zero_row=2, rows=padded))[0] == 0
    assert _replay(_bundle(tmp_path / "judged", zero_row=2))[0] == 1
    code, output = _replay(_bundle(tmp_path / "another-row", zero_row=1, rows=padded))
    assert code == 1 and output.splitlines()[1].startswith("DIFFERS: softmax: "), output


def _edit_info(key: str, value: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        info = json.loads((folder / "bundle.json").read_text())
        info[key] = value
        (folder / "bundle.json").write_text(json.dumps(info))

    return edit


def _case(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / "case.npz").write_bytes(encode_golden([GoldenCase("replay", {}, inputs, outputs)]))

    return edit


def _write(name: str, text: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_text(text)

    return edit


X = np.zeros((2, 3, 4), np.float32)
HOSTILE = [
    ("a deeply nested bundle.json", _write("bundle.json", "[" * 100_000), "bundle.json: not valid JSON ("),
    ("a source that is a list", _edit_info("source", ["m.py"]), "'source' must be a string"),
    ("nodes that are not names", _edit_info("nodes", [1]), "'nodes' must be a list of node names"),
    ("an infinite atol", _edit_info("tolerance", {"atol": 1e400, "rtol": 0}), "must hold a finite atol and rtol"),
    ("a boolean atol", _edit_info("tolerance", {"atol": True, "rtol": 0}), "must hold a finite atol and rtol"),
    ("a negative rtol", _edit_info("tolerance", {"atol": 0, "rtol": -1}), "must hold a finite atol and rtol"),
    ("rows that are not a grid", _edit_info("left_out_rows", [[True], [True, False]]), "'left_out_rows' must be"),
    ("rows that are not booleans", _edit_info("left_out_rows", [[1, 0]]), "'left_out_rows' must be"),
    ("rows leaving out every element", _edit_info("left_out_rows", [[True] * 3] * 2), "is left to compare once"),
    ("an int past float", _edit_info("tolerance", {"atol": 0, "rtol": 0, "atol_rms": 10**400}), "must hold a finite"),
    ("two values", _case({"x": X}, {"softmax": X, "other": X}), "PyTorch's value of 'softmax' alone"),
    ("another value", _case({"x": X}, {"other": X}), "PyTorch's value of 'softmax' alone"),
    ("an input of another dtype", _case({"x": X.astype(np.float64)}, {"softmax": X}), "case.npz's 'x' is float64"),
    ("an input of another shape", _case({"x": X[:1]}, {"softmax": X}), "case.npz's 'x' is float32[1, 3, 4]"),
    ("an input of another name", _case({"y": X}, {"softmax": X}), "region.onnx takes ['x'], case.npz holds ['y']"),
]


@pytest.mark.parametrize(("case", "edit", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_bundle_is_one_line_and_exit_2(tmp_path: Path, case: str, edit: Callable, message: str) -> None:
    folder = _bundle(tmp_path / "b")
    edit(folder)
    code, output = _replay(folder)
    assert code == 2 and message in output, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output


def _lossy_bundle(folder: Path, noise: np.ndarray) -> Path:
    """A region that adds ``noise`` to its input, judged by int8's tolerance (shares of the
    value's rms), as localize judged it."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "noise"], ["y"], name="node_add")],
        "region",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [64])],
        [onnx.ValueInfoProto(name="y")],
        [onnx.numpy_helper.from_array(noise.astype(np.float32), "noise")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    info = {
        "model": "m", "fx_node": "add", "nodes": ["node_add"], "value": "y", "source": "m.py:3", "code": "y = x",
        "tolerance": {"atol": 1e-4, "rtol": 0.05, "atol_rms": 0.25, "rms_rtol": 0.05},
        "localize": "attn-export localize build m",
    }  # fmt: skip
    write_bundle(folder, model.SerializeToString(), {"x": x}, {"y": x}, info)
    return folder


def test_a_bundle_is_judged_by_the_shares_of_the_rms_localize_judged_it_by(tmp_path: Path) -> None:
    """One element off by 0.2 x rms is int8 rounding (replay read atol and rtol alone and
    failed it); every element off by 10 % of itself is a wrong scale."""
    x = np.random.default_rng(0).standard_normal(64)
    spike = np.zeros(64)
    spike[np.argmin(np.abs(x))] = 0.2
    assert _replay(_lossy_bundle(tmp_path / "rounding", spike))[0] == 0
    code, output = _replay(_lossy_bundle(tmp_path / "scale", 0.1 * x))
    assert code == 1 and "rms" in output.splitlines()[1], output


def _external_bundle(folder: Path, tensors: int, length: int, shared: bool) -> Path:
    """A region adding ``tensors`` weights of ``length`` float32 values each to its input,
    the weights kept in ``weights.bin`` beside it: each its own bytes, or all the same ones."""
    weights = []
    for i in range(tensors):
        w = onnx.TensorProto(name=f"w{i}", data_type=onnx.TensorProto.FLOAT, dims=[length])
        w.data_location = onnx.TensorProto.EXTERNAL
        offset = 0 if shared else 4 * length * i
        for key, value in (("location", "weights.bin"), ("offset", offset), ("length", 4 * length)):
            w.external_data.add(key=key, value=str(value))
        weights.append(w)
    names = ["x", *(f"y{i}" for i in range(tensors))]
    nodes = [helper.make_node("Add", [names[i], f"w{i}"], [names[i + 1]], name=f"node_{i}") for i in range(tensors)]
    graph = helper.make_graph(
        nodes,
        "region",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [length])],
        [onnx.ValueInfoProto(name=names[-1])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.zeros(length, np.float32)
    info = {
        "model": "m", "fx_node": "add", "nodes": ["node_0"], "value": names[-1], "source": "m.py:3", "code": "y = x",
        "tolerance": {"atol": 1e-5, "rtol": 1e-4}, "localize": "attn-export localize build m",
    }  # fmt: skip
    write_bundle(folder, model.SerializeToString(), {"x": x}, {names[-1]: x + tensors}, info)
    stored = 1 if shared else tensors
    (folder / "weights.bin").write_bytes(np.ones(stored * length, np.float32).tobytes())
    return folder


def test_external_data_is_read_by_its_distinct_bytes_and_within_the_budget(tmp_path: Path) -> None:
    """Replay read every tensor's external bytes, however many tensors named the same ones:
    a bundle of 20 KB took 4.8 GB under --max-memory 100MiB and exited 0."""
    code, output = _replay(_external_bundle(tmp_path / "own", 3, 16, shared=False))
    assert code == 0, output
    code, output = _replay(_external_bundle(tmp_path / "shared", 3, 16, shared=True))
    assert code == 2, output
    assert output == (
        "Error: refused external data 'weights.bin': its 3 tensors name 192 B in all, 64 B of them distinct "
        "(tensors share bytes, which a save never writes)\n"
    )
    code, output = _replay(_external_bundle(tmp_path / "large", 2, 4096, shared=False), "--max-memory", "16KiB")
    assert code == 2, output
    region = tmp_path / "large" / "region.onnx"
    assert output == f"Error: {region}: its external data is 32.0 KiB, over the memory budget of 16.0 KiB\n"


def test_the_recorded_source_is_printed_escaped(tmp_path: Path) -> None:
    """A bundle is data: its source line printed raw forged a line of the verdict."""
    folder = _bundle(tmp_path / "b", axis=1)
    _edit_info("source", "m.py:3\x1b[2J\nAGREES with PyTorch's recorded value")(folder)
    code, output = _replay(folder)
    assert code == 1 and len(output.splitlines()) == 2, output
    assert "at m.py:3\\x1b[2J\\nAGREES with PyTorch's recorded value on onnxruntime[cpu]" in output


def test_a_bundle_folder_that_cannot_be_made_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OptionError, match=r"^bundle .*file/where: cannot make it: Not a directory"):
        _bundle(tmp_path / "file" / "where")


def test_a_region_that_runs_without_end_is_stopped(tmp_path: Path) -> None:
    """A Loop whose condition stays true ran until the process was killed."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Neg", ["v_in"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", onnx.TensorProto.FLOAT, [4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", onnx.TensorProto.FLOAT, [4]),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["", "cond", "x"], ["y"], body=body, name="node_loop")],
        "region",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [onnx.ValueInfoProto(name="y")],
        [onnx.numpy_helper.from_array(np.array(True), "cond")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    info = {
        "model": "m", "fx_node": "loop", "nodes": ["node_loop"], "value": "y", "source": "m.py:3", "code": "y = x",
        "tolerance": {"atol": 1e-5, "rtol": 1e-4}, "localize": "attn-export localize build m",
    }  # fmt: skip
    x = np.zeros(4, np.float32)
    write_bundle(tmp_path / "b", model.SerializeToString(), {"x": x}, {"y": x}, info)
    with pytest.raises(RuntimeFailure, match=r"^onnxruntime\[cpu\]: the region ran past 0.5 s and was stopped"):
        replay_bundle(tmp_path / "b", timeout_s=0.5)
    stopped = "Error: onnxruntime[cpu]: the region ran past 0.5 s and was stopped (a Loop without end?)\n"
    assert _replay(tmp_path / "b", "--timeout", "0.5") == (1, stopped)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0", "0.0 is not in the range 0<x<=86400.0."),
        ("-3", "-3.0 is not in the range 0<x<=86400.0."),
        ("soon", "'soon' is not a valid float range."),
        ("nan", "'nan' is not a finite number."),
        ("1e9", "1000000000.0 is not in the range 0<x<=86400.0."),
    ],
)
def test_a_time_limit_that_is_no_number_of_seconds_is_a_usage_error(tmp_path: Path, value: str, said: str) -> None:
    """The limit was fixed at 120 s; now a flag, whose bad value is one line, exit 2."""
    folder = _bundle(tmp_path / "b")
    code, output = _replay(folder, "--timeout", value)
    assert code == 2 and output.splitlines()[-1] == f"Error: Invalid value for '--timeout': {said}", output


def test_replay_bundle_refuses_a_time_limit_in_its_own_terms(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^timeout_s: give seconds above 0 and at most 86400, not 0$"):
        replay_bundle(_bundle(tmp_path / "b"), timeout_s=0)
