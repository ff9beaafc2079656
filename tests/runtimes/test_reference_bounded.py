"""onnx.reference bounds a Loop by its run limit wherever the graph holds it: at the top, in
an If's branch, in a model's own function (onnx builds a function's evaluator without the
ops it was given, so a Loop there ran until the process was killed)."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h

from attn_export.errors import RuntimeFailure
from attn_export.model_spec import TensorSpec
from attn_export.runtimes.reference import ReferenceRuntime

ALWAYS = h.make_tensor("always", TensorProto.BOOL, [], [True])
X = h.make_tensor_value_info("x", TensorProto.FLOAT, [2])
Y = h.make_tensor_value_info("y", TensorProto.FLOAT, [2])


def _spin(source: str, out: str) -> list[onnx.NodeProto]:
    """``out``: ``source`` passed through a Loop that never stops."""
    value = [("i", TensorProto.INT64, []), ("c", TensorProto.BOOL, []), ("v", TensorProto.FLOAT, [2])]
    body = h.make_graph(
        [h.make_node("Identity", ["c"], ["co"]), h.make_node("Identity", ["v"], ["vo"])],
        "body",
        [h.make_tensor_value_info(*v) for v in value],
        [h.make_tensor_value_info("co", TensorProto.BOOL, []), h.make_tensor_value_info("vo", TensorProto.FLOAT, [2])],
    )
    return [
        h.make_node("Constant", [], [f"always_{out}"], value=ALWAYS),
        h.make_node("Loop", ["", f"always_{out}", source], [out], body=body),
    ]


def _model(where: str) -> onnx.ModelProto:
    functions = []
    if where == "graph":
        nodes = _spin("x", "y")
    elif where == "if":
        then = h.make_graph(_spin("x", "t"), "then", [], [h.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
        other = h.make_graph([h.make_node("Identity", ["x"], ["e"])], "else", [], [
            h.make_tensor_value_info("e", TensorProto.FLOAT, [2])])  # fmt: skip
        nodes = [h.make_node("Constant", [], ["c"], value=ALWAYS), h.make_node("If", ["c"], ["y"], then_branch=then,
                                                                                else_branch=other)]  # fmt: skip
    else:
        functions = [h.make_function("custom", "Spin", ["a"], ["b"], _spin("a", "b"), [h.make_opsetid("", 18)])]
        nodes = [h.make_node("Spin", ["x"], ["y"], domain="custom")]
    graph = h.make_graph(nodes, where, [X], [Y])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("custom", 1)], functions=functions)


@pytest.mark.parametrize("where", ["graph", "if", "function"])
def test_a_loop_without_end_is_stopped_at_the_limit_and_the_next_run_is_refused(where: str) -> None:
    specs = [TensorSpec("x", "float32", (2,))], [TensorSpec("y", "float32", (2,))]
    with ReferenceRuntime(_model(where).SerializeToString(), *specs, timeout_s=0.3) as runtime:
        started = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"^onnx-reference: ran past 0.3 s and was stopped"):
            runtime.run({"x": np.ones(2, np.float32)})
        assert time.monotonic() - started < 30
        with pytest.raises(RuntimeFailure, match=r"^onnx-reference: not run: an earlier run ran past 0.3 s"):
            runtime.run({"x": np.ones(2, np.float32)})
