"""ONNX Runtime's CPU arena is held to the memory budget: a graph of a few hundred bytes that
asks for gigabytes fails in one line instead of taking them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attn_export.model_spec.memory import format_bytes
from tests.conftest import Built, peak_rss, plant

#: Rows of 16 floats the hostile graph makes: 1.9 GiB.
ROWS = 31_250_000


def _hostile() -> onnx.ModelProto:
    """``tiny``'s inputs and output around a ConstantOfShape of ``ROWS`` times the query's
    last dim (16) floats, summed, at every case."""
    dims = {"query": ["batch", "seq", 16], "keys": ["batch", "kv_seq", 16], "values": ["batch", "kv_seq", 16]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in dims.items()]
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", 16])
    nodes = [
        helper.make_node("Shape", ["query"], ["shape"], start=-1),
        helper.make_node("Mul", ["shape", "rows"], ["big_shape"]),
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"], value=numpy_helper.from_array(np.ones(1, "f4"))),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Mul", ["query", "total"], ["output"]),
    ]
    rows = numpy_helper.from_array(np.array([ROWS], np.int64), "rows")
    graph = helper.make_graph(nodes, "hostile", inputs, [output], [rows])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_graph_that_asks_for_gigabytes_fails_in_one_line_within_the_budget(tiny_build: Built, tmp_path: Path) -> None:
    proto = _hostile()
    assert len(proto.SerializeToString()) < 500
    plant(tiny_build.out, "tiny", proto)
    args = [sys.executable, "-m", "attn_export", "verify", str(tiny_build.out), "--golden", "--no-latency"]
    done, peak = peak_rss([*args, "--max-memory", "100MiB"], cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "Error: onnxruntime[cpu]: ConstantOfShape asked for 1.9 GiB, over the 99.0 MiB left of the memory budget of "
        "100.0 MiB; narrow the dims or raise --max-memory (or $ATTN_EXPORT_MAX_MEMORY, or max_memory in the spec)"
    ]
    # golden mode imports no torch: verify itself peaks at 85 MiB; the graph alone would take 1.9 GiB more
    assert peak < 1 << 30, f"peak RSS {format_bytes(peak)}: ONNX Runtime allocated past the budget"
