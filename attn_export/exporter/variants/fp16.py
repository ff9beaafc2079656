"""fp16: float16 inside, float32 inputs and outputs, Softmax kept in float32 (for CUDA), and
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

    # Constants beyond fp16's range (the -1e9 mask fill) are clamped to +-65504 by the
    # converter, so fully masked rows stay finite.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = convert_float_to_float16(
            _angles_untyped(proto),
            keep_io_types=True,
            op_block_list=["Softmax"],
            node_block_list=_angle_nodes(proto),
            disable_shape_infer=True,
        )
    model = ir.serde.deserialize_model(half)
    model.graph.sort()  # the converter appends its casts out of topological order
    out = ir.serde.serialize_model(model)
    return VariantGraph(
        out, {"precision": "float16 inside, float32 inputs/outputs", "blocked": ["Softmax", "rotary angles"]}
    )


def _angles_untyped(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every value typed but the angles' intermediates and the initializers:
    the converter casts each typed float value between two kept nodes to float16 and back
    (and types an initializer float16 even where it keeps it float32), which would round the
    angles; the Cos and Sin outputs keep their types, and so their casts to float16."""
    kept = set(_angle_nodes(proto))
    inside = {o for n in proto.graph.node if n.name in kept and n.op_type not in ("Cos", "Sin") for o in n.output}
    inside |= {t.name for t in proto.graph.initializer}
    copy = onnx.shape_inference.infer_shapes(proto)  # every other value typed: the converter infers none
    values = [v for v in copy.graph.value_info if v.name not in inside]
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(values)
    return copy


def _angle_nodes(proto: onnx.ModelProto) -> list[str]:
    """Every Cos and Sin node and every node they read from (positions and frequencies only)."""
    makers = {out: node for node in proto.graph.node for out in node.output}
    todo = [n for n in proto.graph.node if n.op_type in ("Cos", "Sin")]
    kept: dict[str, onnx.NodeProto] = {}
    while todo:
        node = todo.pop()
        if node.name not in kept:
            kept[node.name] = node
            todo += [makers[i] for i in node.input if i in makers]
    return sorted(kept)
