"""fp16: float16 inside, float32 inputs and outputs, Softmax kept in float32 (for CUDA: the
opset-23 ``Attention`` op's with ``softmax_precision``), and
rotary angles too: the nodes computing a Cos or Sin (positions times frequencies) stay in
float32, as Hugging Face's rotary embeddings compute them before casting cos and sin to the
model's dtype; in float16 a position of a few hundred is already off by whole radians' worth
of a high frequency.
"""

from __future__ import annotations

import warnings

import onnx

from attn_export._deps import require
from attn_export.exporter.variants import VariantGraph


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    ir = require("onnx_ir", "the fp16 variant")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    angles = _angle_nodes(proto)
    # Constants beyond fp16's range (the -1e9 mask fill) are clamped to +-65504 by the
    # converter, so fully masked rows stay finite.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = convert_float_to_float16(
            _angles_untyped(proto, angles),
            keep_io_types=True,
            op_block_list=["Softmax"],
            node_block_list=angles,
            disable_shape_infer=True,
        )
    for node in half.graph.node:  # the opset-23 op's softmax too: its default is the inputs' float16
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            kept = [a for a in node.attribute if a.name != "softmax_precision"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("softmax_precision", onnx.TensorProto.FLOAT)])
    model = ir.serde.deserialize_model(half)
    model.graph.sort()  # the converter appends its casts out of topological order
    out = ir.serde.serialize_model(model)
    return VariantGraph(
        out, {"precision": "float16 inside, float32 inputs/outputs", "blocked": ["Softmax", "rotary angles"]}
    )


def _angles_untyped(proto: onnx.ModelProto, angles: list[str]) -> onnx.ModelProto:
    """``proto`` with every value typed but the angles' intermediates and the initializers:
    the converter casts each typed float value between two kept nodes to float16 and back
    (and types an initializer float16 even where it keeps it float32), which would round the
    angles; the Cos and Sin outputs keep their types, and so their casts to float16."""
    kept = set(angles)
    inside = {o for n in proto.graph.node if n.name in kept and n.op_type not in ("Cos", "Sin") for o in n.output}
    inside |= {t.name for t in proto.graph.initializer}
    copy = onnx.shape_inference.infer_shapes(proto)  # every other value typed: the converter infers none
    values = [v for v in copy.graph.value_info if v.name not in inside]
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(values)
    return copy


def _angle_nodes(proto: onnx.ModelProto) -> list[str]:
    """Every Cos and Sin node and every node they read from (positions and frequencies), but
    a node whose output something else reads too: that value stays typed and float16 for it,
    and the converter casts it to float32 where the angles read it."""
    makers = {out: node for node in proto.graph.node for out in node.output}
    readers: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    todo = [n for n in proto.graph.node if n.op_type in ("Cos", "Sin")]
    kept: dict[str, onnx.NodeProto] = {}
    while todo:
        node = todo.pop()
        if node.name not in kept:
            kept[node.name] = node
            todo += [makers[i] for i in node.input if i in makers]
    outputs = {o.name for o in proto.graph.output}
    shared = True
    while shared:  # drop a node read from outside the set, then what only it read
        shared = False
        for name, node in list(kept.items()):
            outside = {r for out in node.output for r in readers.get(out, [])} - set(kept)
            if node.op_type not in ("Cos", "Sin") and (outside or set(node.output) & outputs):
                del kept[name]
                shared = True
    return sorted(kept)
