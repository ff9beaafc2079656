"""Three projections of one input as one MatMul: the same numbers in float32, and in int8
each weight rounded with its own scale, as ``quantize_dynamic`` rounds the three apart."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attn_export.exporter.packed_projections import PACKED, pack, packed_weights, unpacked
from attn_export.exporter.variants import make_variant

HIDDEN, COLUMNS = 16, (16, 8, 8)


def _projections(key_range: float, bias: tuple[bool, bool, bool] = (True, True, True)) -> onnx.ModelProto:
    """``x`` projected three times (the key's weight ``key_range`` times as wide as the
    others), the three side by side as the output."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for name, columns, scale, biased in zip("qkv", COLUMNS, (1.0, key_range, 1.0), bias, strict=True):
        w = (rng.standard_normal((HIDDEN, columns)) * scale).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w_{name}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w_{name}"], [f"{name}_mm" if biased else name]))
        if biased:
            weights.append(numpy_helper.from_array(rng.standard_normal(columns).astype(np.float32), f"b_{name}"))
            nodes.append(helper.make_node("Add", [f"b_{name}", f"{name}_mm"], [name]))  # either order
    nodes.append(helper.make_node("Concat", ["q", "k", "v"], ["y"], axis=-1))
    graph = helper.make_graph(
        nodes,
        "projections",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", sum(COLUMNS)])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _packed(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with the Concat reading one packed projection instead of the three."""
    packed = onnx.ModelProto()
    packed.CopyFrom(proto)
    found = pack(packed, ["q", "k", "v"], "p")
    assert found is not None
    name, nodes = found
    packed.graph.ClearField("node")
    packed.graph.node.extend([*nodes, helper.make_node("Identity", [name], ["y"])])
    return packed


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


@pytest.mark.parametrize("bias", [(True, True, True), (True, False, True), (False, False, False)])
def test_the_packed_projection_computes_the_three(bias: tuple[bool, bool, bool]) -> None:
    proto = _projections(1.0, bias)
    packed = _packed(proto)
    assert [n.op_type for n in packed.graph.node] == ["MatMul", *(["Add"] if any(bias) else []), "Identity"]
    assert packed_weights(packed) == {"p/qkv_weight": COLUMNS}
    x = np.random.default_rng(1).standard_normal((1, 5, HIDDEN)).astype(np.float32)
    np.testing.assert_allclose(_run(packed, x), _run(proto, x), rtol=1e-6, atol=1e-6)


def test_projections_of_two_inputs_or_read_twice_are_not_packed() -> None:
    proto = _projections(1.0)
    proto.graph.node[2].input[0] = "other"  # the key's MatMul reads another input
    assert pack(proto, ["q", "k", "v"], "p") is None
    proto = _projections(1.0)
    proto.graph.output.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, None))  # k read twice
    assert pack(proto, ["q", "k", "v"], "p") is None


def _cut(bounds: list[tuple[int, int, int]]) -> onnx.ModelProto:
    """One projection of ``x`` (32 columns) cut into q, k and v, a ``Slice`` (start, end,
    axis) each, as Phi-3 cuts its own ``qkv_proj``."""
    weights = [numpy_helper.from_array(np.ones((HIDDEN, sum(COLUMNS)), np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["qkv"])]
    for name, (start, end, axis) in zip("qkv", bounds, strict=True):
        for what, value in (("start", start), ("end", end), ("axis", axis)):
            weights.append(numpy_helper.from_array(np.array([value], np.int64), f"{name}_{what}"))
        nodes.append(helper.make_node("Slice", ["qkv", f"{name}_start", f"{name}_end", f"{name}_axis"], [name]))
    graph = helper.make_graph(
        nodes,
        "cut",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", HIDDEN])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "qkv"],
        weights,
        value_info=[helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "seq", sum(COLUMNS)])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


END = np.iinfo(np.int64).max


@pytest.mark.parametrize(
    ("bounds", "packed"),
    [
        ([(0, 16, -1), (16, 24, -1), (24, END, -1)], True),
        ([(0, 16, 2), (16, 24, 2), (24, 32, 2)], True),
        ([(0, 16, -1), (16, 24, -1), (25, END, -1)], False),  # a column left out
        ([(16, 24, -1), (0, 16, -1), (24, END, -1)], False),  # the query's columns not first
        ([(0, 16, -1), (16, 24, -1), (24, 30, -1)], False),  # the last columns left out
        ([(0, 1, 1), (1, 2, 1), (2, END, 1)], False),  # cut along the positions
    ],
    ids=["to-the-end", "to-the-width", "gap", "reordered", "short", "other-axis"],
)
def test_a_projection_cut_end_to_end_is_read_whole(bounds: list[tuple[int, int, int]], packed: bool) -> None:
    """Query, key and value cut from one projection, end to end in that order, are that
    projection as it is: no nodes made; cut any other way they are not packed at all."""
    found = pack(_cut(bounds), ["q", "k", "v"], "p")
    assert found == (("qkv", []) if packed else None)


def test_int8_rounds_each_packed_weight_with_its_own_scale() -> None:
    """With the key's weight 8x as wide, one scale over the packed weight rounds the query's
    and value's 8x as coarsely as quantizing the three apart; each part's own scale gives
    the three apart's numbers."""
    proto = _projections(8.0)
    x = np.random.default_rng(1).standard_normal((1, 5, HIDDEN)).astype(np.float32)
    apart = _run(make_variant("int8", proto).proto, x)
    packed = make_variant("int8", _packed(proto)).proto
    np.testing.assert_allclose(_run(packed, x), apart, rtol=1e-5, atol=1e-5)
    scales = {t.name: numpy_helper.to_array(t) for t in packed.graph.initializer if t.name.endswith("_scale")}
    parts = np.split(scales["p/qkv_weight_scale"], np.cumsum(COLUMNS)[:-1])
    assert [len(set(p.tolist())) for p in parts] == [1, 1, 1] and parts[1][0] > 4 * parts[0][0]
    marked = [n for n in packed.graph.node if any(p.key == PACKED for p in n.metadata_props)]
    assert [(n.op_type, n.output[0]) for n in marked] == [("Mul", "p/qkv_matmul")]  # the value the MatMul gave


@pytest.mark.parametrize(("variant", "atol"), [("int8", 0.0), ("int4", 1e-5)])
@pytest.mark.parametrize("bias", [(True, True, True), (True, False, True), (False, False, False)])
def test_a_quantized_packed_projection_is_taken_apart_at_slices_of_its_value(
    bias: tuple[bool, bool, bool], variant: str, atol: float
) -> None:
    """int8 replaces the packed MatMul by MatMulInteger and its scales, int4 by a
    MatMulNBits: the record goes on to the node giving the packed value, and localization
    cuts that value into the three, each a Slice with its projection's name and metadata (a
    fault in the key's columns was blamed on the attention the packed nodes fed, not on the
    key's projection). The numbers stay, up to float32 rounding after int4: ONNX Runtime
    folds the packed bias Add into the MatMulNBits, and the parts' Adds it cannot."""
    proto = _projections(8.0, bias)
    for node in proto.graph.node:
        node.name = f"node_{node.output[0]}"
        node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=f"%{node.output[0]} : fake")
    quantized = make_variant(variant, _packed(proto)).proto
    apart = unpacked(quantized)
    made = {n.output[0]: n for n in apart.graph.node}
    for name, biased in zip("qkv", bias, strict=True):
        projection = made[f"{name}_mm" if biased else name]
        assert (projection.name, projection.op_type) == (f"node_{name}_mm" if biased else f"node_{name}", "Slice")
        assert {p.key: p.value for p in projection.metadata_props} == {
            "pkg.torch.onnx.fx_node": f"%{projection.output[0]} : fake"
        }
    assert made["p/qkv"].op_type == "Concat"
    assert not any(p.key == PACKED for n in apart.graph.node for p in n.metadata_props)
    x = np.random.default_rng(1).standard_normal((1, 5, HIDDEN)).astype(np.float32)
    np.testing.assert_allclose(_run(apart, x), _run(quantized, x), rtol=0, atol=atol)


@pytest.mark.parametrize("bias", [(True, True, True), (True, False, True), (False, False, False)])
def test_unpacked_gives_each_projection_back_with_its_name_and_metadata(bias: tuple[bool, bool, bool]) -> None:
    """Localization takes a packed projection apart again: each MatMul (and bias Add) as
    the export made it, traced to its FX node, the packed value their Concat."""
    proto = _projections(1.0, bias)
    for node in proto.graph.node:
        node.name = f"node_{node.output[0]}"
        node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=f"%{node.output[0]} : fake")
    packed = _packed(proto)
    apart = unpacked(packed)
    made = {n.output[0]: n for n in apart.graph.node}
    for name, biased in zip("qkv", bias, strict=True):
        node = made[name]
        assert node.name == f"node_{name}" and node.op_type == ("Add" if biased else "MatMul")
        assert {p.key: p.value for p in node.metadata_props} == {"pkg.torch.onnx.fx_node": f"%{name} : fake"}
    # a part without a bias of its own still adds its share of the packed bias, untraced
    joined = [n if b or not any(bias) else f"{n}/bias" for n, b in zip("qkv", bias, strict=True)]
    assert made["p/qkv"].op_type == "Concat" and list(made["p/qkv"].input) == joined
    x = np.random.default_rng(1).standard_normal((1, 5, HIDDEN)).astype(np.float32)
    np.testing.assert_array_equal(_run(apart, x), _run(packed, x))
    if any(bias):  # an edit of the packed bias where a part had none is kept, not dropped
        (packed_bias,) = [t for t in packed.graph.initializer if t.name == "p/qkv_bias"]
        edited = numpy_helper.to_array(packed_bias) + 0.5
        packed_bias.CopyFrom(numpy_helper.from_array(edited, packed_bias.name))
        np.testing.assert_array_equal(_run(unpacked(packed), x), _run(packed, x))
    assert unpacked(proto) is proto  # nothing packed: the graph itself


def _parts_named(output: str, name: str) -> str:
    """A packed record of the right width whose first projection gives back ``output``
    made by node ``name``."""
    first = {"columns": COLUMNS[0], "matmul": {"name": name, "output": output, "metadata": {}}, "add": None}
    rest = [
        {"columns": n, "matmul": {"name": f"m{k}", "output": f"o{k}", "metadata": {}}, "add": None}
        for k, n in enumerate(COLUMNS[1:])
    ]
    return json.dumps([first, *rest])


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ("not json", "metadata is not JSON"),
        ("[]", "metadata is malformed"),
        ('[{"columns": -1, "matmul": null, "add": null}]', "metadata is malformed"),
        ('[{"columns": 8, "matmul": {"name": "m", "output": "o", "metadata": {}}, "add": null}]', "holds 8 columns"),
        ('[{"columns": 8, "matmul": {"name": "m", "output": "o", "metadata": {}}, "add": "x"}]', "is malformed"),
        ('[{"columns": 8, "matmul": {"name": "m", "output": "o"}, "add": null}]', "is malformed"),
        ('[{"columns": 8, "matmul": {"name": "m", "output": "o", "metadata": [1]}, "add": null}]', "is malformed"),
        ('[{"columns": Infinity, "matmul": {"name": "m", "output": "o", "metadata": {}}, "add": null}]', "malformed"),
        ("[" * 100_000, "is not JSON"),
        (_parts_named("x", "m"), "gives back 'x'"),  # an input's name
        (_parts_named("o", "p/qkv_matmul"), "node 'p/qkv_matmul'"),  # the packed node's own name
    ],
)
def test_a_packed_record_that_does_not_fit_its_graph_is_refused_in_one_line(record: str, says: str) -> None:
    """A graph is data: localization reads the record a packed MatMul carries, and one that
    is not a list of projections, or not of its weight's width, is an ArtifactError."""
    from attn_export.errors import ArtifactError

    packed = _packed(_projections(1.0))
    (matmul,) = [n for n in packed.graph.node if n.op_type == "MatMul"]
    (entry,) = [p for p in matmul.metadata_props if p.key == PACKED]
    entry.value = record
    with pytest.raises(ArtifactError, match=says):
        unpacked(packed)
