"""int8: ``onnxruntime.quantization.quantize_dynamic`` on MatMuls (int8 weights, dynamic
activations)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx

from attn_export.exporter.variants import VariantGraph, op_counts


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """Weights are quantized to 7 bits (``reduce_range``): CPUs without VNNI saturate
    int16 accumulators with full-range u8 x s8 products, so 8-bit weights would give
    machine-dependent results."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(proto, src)
        logger = logging.getLogger()
        level = logger.level
        logger.setLevel(logging.ERROR)  # quantize_dynamic logs a pre-processing hint on root
        try:
            quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8, reduce_range=True)
        finally:
            logger.setLevel(level)
        out = onnx.load(dst)
    info = {"quantized": "MatMul weights int8 (7-bit range), activations dynamic", "ops": dict(op_counts(out))}
    return VariantGraph(out, info)
