"""Messages that send the user the right way: a training-mode Dropout in a graph exported in
eval mode points at the call that asked for it, and the pytest plugin names its own flag."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from attn_export.errors import GraphCheckError, UsageError
from attn_export.exporter.graph_checks import check_deterministic, check_model
from attn_export.pipelines.verify import checkout_spec


def test_a_training_mode_dropout_points_at_the_call_that_asks_for_it() -> None:
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="drop")],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
        [
            numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
            numpy_helper.from_array(np.array(True), "training"),
        ],
    )
    with pytest.raises(GraphCheckError) as caught:
        check_deterministic(helper.make_model(graph), "m")
    assert "Dropout node 'drop' with training_mode = true" in str(caught.value)
    assert "F.dropout(..., training=True)" in str(caught.value) and "training=self.training" in str(caught.value)


def test_a_random_op_inside_a_branch_or_a_function_is_refused_like_one_in_the_graph() -> None:
    noise = helper.make_node("RandomNormalLike", ["x"], ["n"], name="noise")
    branch = helper.make_graph([noise], "branch", [], [helper.make_tensor_value_info("n", onnx.TensorProto.FLOAT, [2])])
    cond = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch, name="if")
    graph = helper.make_graph(
        [cond],
        "g",
        [helper.make_tensor_value_info(n, t, [2] if n == "x" else []) for n, t in (("x", 1), ("c", 9))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    with pytest.raises(GraphCheckError, match="a random op, RandomNormalLike node 'noise'"):
        check_deterministic(helper.make_model(graph), "m")
    function = helper.make_function("local", "jitter", ["x"], ["n"], [noise], [helper.make_opsetid("", 18)])
    call = helper.make_node("jitter", ["x"], ["y"], domain="local", name="call")
    graph = helper.make_graph(
        [call], "g", [helper.make_tensor_value_info("x", 1, [2])], [helper.make_tensor_value_info("y", 1, [2])]
    )
    model = helper.make_model(graph, functions=[function], opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(GraphCheckError, match="a random op, RandomNormalLike node 'noise'"):
        check_deterministic(model, "m")


def test_a_missing_spec_names_the_flag_of_the_entry_point_that_asked(tmp_path: Path) -> None:
    for option in ("--models", "--attn-export-models"):
        with pytest.raises(UsageError, match=f"pass {option} DIR"):
            checkout_spec(tmp_path, _Entry("gone"), option)  # type: ignore[arg-type]


class _Entry:
    """The one thing checkout_spec reads of a manifest entry: the name of its model spec."""

    def __init__(self, name: str) -> None:
        self.model_spec = type("Spec", (), {"name": name})()


def _normalized(
    op: str = "SimplifiedLayerNormalization", inputs: int = 2, after: int = 4, **attrs: object
) -> onnx.ModelProto:
    """``op`` in the ONNX domain, as onnxscript's ORT fusions write SimplifiedLayerNormalization,
    then a MatMul by a ``[after, 3]`` weight."""
    norm = helper.make_node(op, ["x", "scale", "scale"][:inputs], ["y"], axis=-1, epsilon=1e-5, **attrs)
    graph = helper.make_graph(
        [norm, helper.make_node("MatMul", ["y", "w"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["batch", 3])],
        [
            numpy_helper.from_array(np.ones(4, np.float32), "scale"),
            numpy_helper.from_array(np.ones((after, 3), np.float32), "w"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_an_op_onnx_runtime_runs_in_the_onnx_domain_is_checked_against_its_schema(tmp_path: Path) -> None:
    """ONNX has no schema for SimplifiedLayerNormalization; ONNX Runtime declares one, and
    the checker holds the op and what follows it to that schema."""
    check_model(_normalized(stash_type=1), "m")
    onnx.save(_normalized(), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0, location="m.data")
    check_model(onnx.load(tmp_path / "m.onnx", load_external_data=False), "m", tmp_path / "m.onnx")
    for broken, why in (
        (_normalized("NoSuchNormalization"), "No Op registered for NoSuchNormalization"),
        (_normalized(inputs=3), "input size 3 not in range"),
        (_normalized(colour=1), "Unrecognized attribute: colour"),
        (_normalized(after=5), "Incompatible dimensions for matrix multiplication"),
    ):
        with pytest.raises(GraphCheckError, match=why):
            check_model(broken, "m")


def _reshaped(target: list[int], weight: int = 6) -> onnx.ModelProto:
    """``[batch, 6] @ [weight, 6]`` reshaped to ``target``, whose values shape inference reads."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Reshape", ["m", "target"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 2, 3])],
        [
            numpy_helper.from_array(np.array(target, np.int64), "target"),
            numpy_helper.from_array(np.ones((weight, 6), np.float32), "w"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_graph_keeping_its_shape_constants_in_external_data_is_checked_with_them(tmp_path: Path) -> None:
    """onnx's full check cannot read external data: a valid graph whose Reshape target lies
    there was refused. The check now reads the small tensors in, and still refuses a target
    or a weight that does not fit."""
    for case, model, why in (
        ("fits", _reshaped([-1, 2, 3]), None),
        ("target", _reshaped([-1, 4, 5]), "Reshape"),
        ("weight", _reshaped([-1, 2, 3], weight=5), "Incompatible dimensions"),
    ):
        path = tmp_path / case / "m.onnx"
        path.parent.mkdir()
        onnx.save(model, path, save_as_external_data=True, size_threshold=0, location="m.data")
        on_disk = onnx.load(path, load_external_data=False)
        if why is None:
            check_model(on_disk, "m", path)
        else:
            with pytest.raises(GraphCheckError, match=why):
                check_model(on_disk, "m", path)


def test_the_checkers_refusal_names_the_node_on_its_second_line() -> None:
    """onnx.checker names the node on the line after the first: the message stopped at
    "of node: " and never said which."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["y"], name="late"), helper.make_node("Neg", ["x"], ["h"], name="early")],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    with pytest.raises(GraphCheckError) as caught:
        check_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), "m")
    said = str(caught.value)
    assert "\n" not in said and "topologically sorted" in said and "name: late OpType: Relu" in said, said
