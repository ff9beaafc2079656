"""inspect describes any ONNX file, ours or not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from attn_export.cli import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_inspect_our_model(zoo_dir: Path) -> None:
    result = invoke("inspect", str(zoo_dir / "mha_attention_op.onnx"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["opsets"]["ai.onnx"] == 23 and doc["ops"]["Attention"] == 1
    assert doc["inputs"][1] == {"name": "keys", "dtype": "float32", "shape": ["batch", "kv_seq", 32]}
    assert doc["metadata"]["attn_export.model"] == "mha_attention_op"
    weights = 4 * (32 * 32 + 32)  # four Linear layers; the rest are a few scalar constants
    assert 0 <= doc["parameters"] - weights < 16 and doc["parameter_bytes"] >= 4 * weights
    assert doc["kernels_ok"] is True and doc["external_data"] == []


def test_inspect_json_round_trips(zoo_dir: Path) -> None:
    from attn_export.pipelines.inspect import InspectResult, inspect_file

    result = inspect_file(zoo_dir / "mha.onnx")
    assert InspectResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_inspect_text(zoo_dir: Path) -> None:
    result = invoke("inspect", str(zoo_dir / "sdpa.onnx"))
    assert result.exit_code == 0
    assert "  q                float32  [batch, seq, 16]" in result.output
    assert "kernels:     cpu: every op has a kernel" in result.output


def _foreign_model(tmp_path: Path, op: str = "Relu", domain: str = "") -> Path:
    """A model not built by us: a named op, a dim with no name, one initializer in external data."""
    weight = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    (tmp_path / "weights.bin").write_bytes(np.ones(4, np.float32).tobytes())
    weight.ClearField("float_data")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "weights.bin"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=k, value=v)
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]), helper.make_node(op, ["h"], ["y"], domain=domain)]
    graph = helper.make_graph(
        nodes,
        "foreign",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", None, 4])],
        initializer=[weight],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="someone-else")
    model.ir_version = 9
    path = tmp_path / "foreign.onnx"
    onnx.save(model, path)
    return path


def test_inspect_foreign_model_with_external_data(tmp_path: Path) -> None:
    result = invoke("inspect", str(_foreign_model(tmp_path)), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["producer"] == "someone-else" and doc["external_data"] == ["weights.bin"]
    assert doc["inputs"][0]["shape"] == ["n", None, 4]
    assert doc["ops"] == {"Add": 1, "Relu": 1} and doc["parameters"] == 4


def test_inspect_reports_an_op_without_kernel(tmp_path: Path) -> None:
    result = invoke("inspect", str(_foreign_model(tmp_path, op="NoSuchOp", domain="custom.domain")))
    assert result.exit_code == 1
    assert "kernels:     cpu: MISSING: " in result.output and "NoSuchOp" in result.output


def test_inspect_a_model_with_an_unknown_element_type(zoo_dir: Path, tmp_path: Path) -> None:
    model = onnx.load(zoo_dir / "sdpa.onnx")
    model.graph.input[0].type.tensor_type.elem_type = 999
    onnx.save(model, tmp_path / "odd.onnx")
    result = invoke("inspect", str(tmp_path / "odd.onnx"))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "  q                unknown (999) [batch, seq, 16]" in result.output
    assert "checker:     REJECTED: " in result.output


def test_inspect_counts_parameters_without_overflow(zoo_dir: Path, tmp_path: Path) -> None:
    model = onnx.load(zoo_dir / "sdpa.onnx")
    for name, dims in (("huge", [2**40, 2**40]), ("negative", [4, -3])):
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT)
        tensor.dims.extend(dims)
        model.graph.initializer.append(tensor)
    onnx.save(model, tmp_path / "big.onnx")
    before = json.loads(invoke("inspect", str(zoo_dir / "sdpa.onnx"), "--json").output)
    result = invoke("inspect", str(tmp_path / "big.onnx"), "--json")
    assert result.exit_code == 1, result.output  # the checker rejects both tensors
    doc = json.loads(result.output)
    assert doc["parameters"] == before["parameters"] + 2**80  # numpy's int64 product wrapped this to 1
    assert doc["parameter_bytes"] == before["parameter_bytes"] + 4 * 2**80
