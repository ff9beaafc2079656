"""fp16: float16 inside, float32 inputs and outputs, Softmax kept in float32 (for CUDA)."""

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
        half = convert_float_to_float16(proto, keep_io_types=True, op_block_list=["Softmax"])
    model = ir.serde.deserialize_model(half)
    model.graph.sort()  # the converter appends its casts out of topological order
    out = ir.serde.serialize_model(model)
    return VariantGraph(out, {"precision": "float16 inside, float32 inputs/outputs", "blocked": ["Softmax"]})
