"""int8: ``onnxruntime.quantization.quantize_dynamic`` on MatMuls (int8 weights, dynamic
activations)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from attn_export.errors import ExportFailure
from attn_export.exporter.packed_projections import keep_records, packed_records, packed_weights
from attn_export.exporter.variants import VariantGraph, op_counts


def _round_parts_apart(source: onnx.ModelProto, out: onnx.ModelProto) -> None:
    """Give each weight in a packed projection its own scale, as if it were quantized alone:
    one scale over all three would round the narrowest as coarsely as the widest, where
    the module's simulated int8 rounding (``runtimes/int8_rounding.py``) rounds each apart.
    MatMulInteger's output scale becomes one per column."""
    from onnxruntime.quantization.quant_utils import quantize_data

    weights = {t.name: t for t in source.graph.initializer}
    made = {t.name: t for t in out.graph.initializer}
    for name, columns in packed_weights(source).items():
        quantized, scale, zero = (made.get(f"{name}_{part}") for part in ("quantized", "scale", "zero_point"))
        if quantized is None or scale is None or zero is None:
            raise ExportFailure(f"variant int8: quantize_dynamic left no int8 weight for the packed weight '{name}'")
        parts = np.split(numpy_helper.to_array(weights[name]), np.cumsum(columns)[:-1], axis=1)
        rounded = [quantize_data(p.ravel(), TensorProto.INT8, True, reduce_range=True) for p in parts]
        if any(np.any(zp != 0) for zp, _, _ in rounded) or np.any(numpy_helper.to_array(zero) != 0):
            raise ExportFailure(f"variant int8: the packed projection '{name}' was not quantized symmetrically")
        ints = np.concatenate([q.reshape(p.shape) for (_, _, q), p in zip(rounded, parts, strict=True)], axis=1)
        scales = np.concatenate([np.full(n, s, np.float32) for (_, s, _), n in zip(rounded, columns, strict=True)])
        quantized.CopyFrom(numpy_helper.from_array(ints.astype(np.int8), quantized.name))
        scale.CopyFrom(numpy_helper.from_array(scales, scale.name))


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
    _round_parts_apart(proto, out)
    keep_records(packed_records(proto), out)  # localization still takes the packed projection apart
    info = {"quantized": "MatMul weights int8 (7-bit range), activations dynamic", "ops": dict(op_counts(out))}
    return VariantGraph(out, info)
