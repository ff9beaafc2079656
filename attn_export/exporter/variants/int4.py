"""int4: ONNX Runtime's ``MatMulNBitsQuantizer`` on MatMuls (4-bit weights in blocks of 32
along the reduced axis, symmetric; accuracy level 4: on a CPU the activations rounded to int8
per block and the products in integers), the quantization onnxruntime-genai deploys on CPU."""

from __future__ import annotations

import logging

import onnx

from attn_export.errors import ExportFailure
from attn_export.exporter.packed_projections import keep_records, packed_records
from attn_export.exporter.variants import VariantGraph, op_counts
from attn_export.runtimes.int8_rounding import INT4_ACCURACY_LEVEL, INT4_BLOCK


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """Symmetric blocks at accuracy level 4, as the simulated rounding (``in_int8(bits=4)``)
    rounds them and genai's model builder makes them for a CPU: its int8 kernels take half
    the time of the float32 ones at one token a step, and a right graph differs from the
    module by the weights' and activations' rounding alone."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    records = packed_records(proto)  # the quantizer rewrites proto in place, dropping them
    quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.ERROR)  # it logs every MatMul it quantizes or skips
    try:
        config = DefaultWeightOnlyQuantConfig(
            block_size=INT4_BLOCK, is_symmetric=True, accuracy_level=INT4_ACCURACY_LEVEL
        )
        quantizer = MatMulNBitsQuantizer(proto, algo_config=config)
        quantizer.process()
        out = quantizer.model.model
    finally:
        quantizer_log.setLevel(level)
    counts = op_counts(out)
    if not counts.get("com.microsoft.MatMulNBits"):
        raise ExportFailure("variant int4: no MatMul has a constant weight to quantize (MatMulNBits needs one)")
    keep_records(records, out)  # localization still takes the packed projection apart
    info = {
        "quantized": (
            f"MatMul weights int4, symmetric blocks of {INT4_BLOCK}, accuracy level {INT4_ACCURACY_LEVEL} "
            "(int8 activations on a CPU)"
        ),
        "ops": dict(counts),
    }
    return VariantGraph(out, info)
