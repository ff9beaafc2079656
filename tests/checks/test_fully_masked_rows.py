"""What fully masked rows give, told on a graph with nothing to rewrite (a fused op's
stand-in): 0 and NaN show by themselves, anything else is unknown, and a case with no
fully masked row is unknown rather than a vacuous 0; with the model's plain export at hand,
its rewrites tell every side what it gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from attn_export.artifacts.golden import GoldenCase
from attn_export.checks.fully_masked import FullyMaskedRows
from attn_export.model_spec import Tolerance, load_spec
from tests.conftest import write_spec

SPEC = """
module = "torch.nn:Identity"

[[inputs]]
name = "x"
shape = ["batch", "seq", 4]
[[inputs]]
name = "key_padding_mask"
dtype = "bool"
shape = ["batch", "seq"]
mask = "padding"
convention = "ignore"

[[outputs]]
name = "y"
shape = ["batch", "seq", 4]

[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 8 }
"""


def _passthrough() -> bytes:
    """``y = x``: no Softmax, so the rewrites cannot tell anything apart."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4]),
            helper.make_tensor_value_info("key_padding_mask", TensorProto.BOOL, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _attention() -> bytes:
    """The same model's plain export: ``y = Softmax(x x^T masked) x``, its padded keys
    filled with float32's lowest, which the rewrites take."""
    h = helper
    lowest = h.make_tensor("lowest", TensorProto.FLOAT, [], [float(np.finfo(np.float32).min)])
    axis = h.make_tensor("axis", TensorProto.INT64, [1], [1])
    nodes = [
        h.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        h.make_node("MatMul", ["x", "xt"], ["scores"]),
        h.make_node("Unsqueeze", ["key_padding_mask", "axis"], ["hidden"]),
        h.make_node("Where", ["hidden", "lowest", "scores"], ["masked"]),
        h.make_node("Softmax", ["masked"], ["weights"], axis=-1),
        h.make_node("MatMul", ["weights", "x"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [
            h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4]),
            h.make_tensor_value_info("key_padding_mask", TensorProto.BOOL, ["batch", "seq"]),
        ],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
        initializer=[lowest, axis],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]).SerializeToString()


def test_a_graph_with_nothing_to_rewrite_is_labelled_by_the_plain_export(tmp_path: Path) -> None:
    """PyTorch's rows are PyTorch's whichever graph it is judged with: where the graph is
    fused, the plain export's rewrites say 0 or the mean of V, for PyTorch and the graph."""
    spec = load_spec(write_spec(tmp_path, "m", SPEC))
    padded = np.array([[True, True, True], [False, False, True]])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    case = GoldenCase("fully-padded-sequence", {"batch": 2, "seq": 3}, {"x": x, "key_padding_mask": padded})
    zero, mean = x.copy(), x.copy()
    zero[0], mean[0] = 0, x[0].mean(axis=0)
    with FullyMaskedRows(spec, _passthrough(), {"y": Tolerance(1e-5, 1e-4)}, plain=_attention) as rows:
        assert rows.behaviours(case, {"y": zero}, {"y": mean}, {"y": x}) == ["0", "mean of V", "other"]


def test_rows_with_nothing_to_rewrite_are_told_by_sight(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, "m", SPEC))
    padded = np.array([[True, True, True], [False, False, True]])  # True = ignore: sequence 0 sees no key
    x = np.ones((2, 3, 4), np.float32)
    case = GoldenCase("fully-padded-sequence", {"batch": 2, "seq": 3}, {"x": x, "key_padding_mask": padded})
    zero, nan, other = (x.copy() for _ in range(3))
    zero[0], nan[0] = 0, np.nan
    with FullyMaskedRows(spec, _passthrough(), {"y": Tolerance(1e-5, 1e-4)}) as rows:
        gives = rows.behaviours(case, {"y": zero}, {"y": nan}, {"y": other})
        assert gives == ["0", "NaN", "unknown"]
        none = GoldenCase("fully-padded-sequence", case.sizes, {"x": x, "key_padding_mask": np.zeros((2, 3), bool)})
        assert rows.behaviours(none, {"y": zero}) == ["unknown"]  # no row sees no key: nothing to tell


def test_a_plain_export_that_cannot_be_read_labels_nothing(tmp_path: Path) -> None:
    """It only labels: a file that is no graph leaves the rows as without one."""
    spec = load_spec(write_spec(tmp_path, "m", SPEC))
    bad = tmp_path / "plain.onnx"
    bad.write_bytes(b"not a graph")
    x = np.ones((2, 3, 4), np.float32)
    padded = np.array([[True, True, True], [False, False, True]])
    case = GoldenCase("fully-padded-sequence", {"batch": 2, "seq": 3}, {"x": x, "key_padding_mask": padded})
    zero = x.copy()
    zero[0] = 0
    with FullyMaskedRows(spec, _passthrough(), {"y": Tolerance(1e-5, 1e-4)}, plain=bad) as rows:
        assert rows.behaviours(case, {"y": zero}, {"y": x}) == ["0", "unknown"]


def test_elements_left_out_are_not_counted_as_compared() -> None:
    """A case whose every element is left out compared nothing: it fails as proving nothing
    (it passed, counted among the cases that agree)."""
    from attn_export.checks.fully_masked import _compare_left_out

    case = GoldenCase("c", {}, outputs={"y": np.zeros((2, 3), np.float32)})
    actual = {"y": np.ones((2, 3), np.float32)}
    tol = {"y": Tolerance(1e-5, 0.0)}
    some = _compare_left_out(case, actual, {"y": np.array([[True] * 3, [False] * 3])}, tol)
    assert some[0].total == 3 and some[0].mismatched == 3
    every = _compare_left_out(case, actual, {"y": np.ones((2, 3), bool)}, tol)
    assert every[0].total == 0 and every[0].passed
