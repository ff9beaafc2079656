"""Stage: graph variants derived from the plain fp32 export of one spec.

Each variant is a function of the fp32 graph (and, for ``attention-op``, a re-export at
opset 23). Every variant is checked, smoke-tested and verified like the fp32 graph, with
its own tolerance: faster graphs are only worth having while they stay correct.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from attn_export._deps import require
from attn_export.errors import ExportFailure, UsageError
from attn_export.spec import VARIANT_DEFAULT_TOLERANCES, VARIANT_NAMES

__all__ = ["DEFAULT_TOLERANCES", "VARIANTS", "VariantGraph", "make_variant", "variant_key"]

VARIANTS = VARIANT_NAMES
DEFAULT_TOLERANCES = VARIANT_DEFAULT_TOLERANCES
#: Attention ops a fused or attention-op graph must contain to be worth building.
ATTENTION_OPS = {"Attention", "com.microsoft.MultiHeadAttention", "com.microsoft.Attention"}


@dataclass
class VariantGraph:
    """A variant's graph, plus what the transformation did (recorded in the manifest)."""

    proto: onnx.ModelProto
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def variant_key(model: str, variant: str) -> str:
    """Manifest key and file stem: the plain graph keeps the model's name."""
    return model if variant == "fp32" else f"{model}.{variant}"


def _ops(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)


def _simplify_dims(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite symbolic dims such as '((kv_seq*batch)//batch)' to 'kv_seq' so pattern
    fusions can prove shapes equal; dims that do not simplify to one symbol stay."""
    sympy = require("sympy", "simplifying symbolic dims")
    values = list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output)
    dims = [d for v in values for d in v.type.tensor_type.shape.dim if d.dim_param]
    names = {n for d in dims for n in re.findall(r"[A-Za-z_]\w*", d.dim_param)}
    symbols = {n: sympy.Symbol(n, positive=True, integer=True) for n in names}
    for d in dims:
        if re.fullmatch(r"[A-Za-z_]\w*", d.dim_param):
            continue
        try:
            expr = sympy.simplify(sympy.sympify(d.dim_param, locals=symbols))
        except (sympy.SympifyError, TypeError, SyntaxError):
            continue
        if isinstance(expr, sympy.Symbol):
            d.dim_param = expr.name
    return proto


def _ort_fused(proto: onnx.ModelProto) -> VariantGraph:
    ir = require("onnx_ir", "the ort-fused variant")
    ort_fusions = require("onnxscript.rewriter.ort_fusions", "the ort-fused variant")
    model = ir.serde.deserialize_model(_simplify_dims(proto))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, counts = ort_fusions.optimize_for_ort(model)
    out = ir.serde.serialize_model(fused)
    applied = {k: v for k, v in counts.items() if v}
    result = VariantGraph(out, {"fusions": applied, "ops": dict(_ops(out))})
    if not set(_ops(out)) & ATTENTION_OPS:
        result.warnings.append("no attention fusion applied; the graph is the fp32 one with minor rewrites")
    return result


def _int8(proto: onnx.ModelProto) -> VariantGraph:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(proto, src)
        logger = logging.getLogger()
        level = logger.level
        logger.setLevel(logging.ERROR)  # quantize_dynamic logs a pre-processing hint on root
        try:
            quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
        finally:
            logger.setLevel(level)
        out = onnx.load(dst)
    return VariantGraph(out, {"quantized": "MatMul weights int8, activations dynamic", "ops": dict(_ops(out))})


def _fp16(proto: onnx.ModelProto) -> VariantGraph:
    ir = require("onnx_ir", "the fp16 variant")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # Inputs and outputs stay float32; constants beyond fp16's range (the -1e9 mask fill)
    # are clamped to +-65504 by the converter, so fully masked rows stay finite.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = convert_float_to_float16(proto, keep_io_types=True, op_block_list=["Softmax"])
    model = ir.serde.deserialize_model(half)
    model.graph.sort()  # the converter appends its casts out of topological order
    out = ir.serde.serialize_model(model)
    return VariantGraph(out, {"precision": "float16 inside, float32 inputs/outputs", "blocked": ["Softmax"]})


def _ort_optimized(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    import onnxruntime as ort

    from attn_export.runtimes.ort import require_provider

    ep = require_provider(provider)
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # EXTENDED keeps the graph portable across machines (ALL adds CPU-layout transforms).
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(dst)
        ort.InferenceSession(proto.SerializeToString(), options, providers=[ep])
        out = onnx.load(dst)
    return VariantGraph(out, {"provider": provider, "level": "extended", "ops": dict(_ops(out))})


def make_variant(
    variant: str,
    fp32: onnx.ModelProto,
    reexport: Callable[[int], onnx.ModelProto],
    provider: str = "cpu",
) -> VariantGraph:
    """Derive ``variant`` from the fp32 graph; ``reexport(opset)`` exports the module again."""
    if variant == "fp32":
        return VariantGraph(fp32)
    if variant == "attention-op":
        proto = fp32 if fp32.opset_import[0].version >= 23 else reexport(23)
        if "Attention" not in _ops(proto):
            raise ExportFailure(
                "variant attention-op needs a module that calls F.scaled_dot_product_attention "
                "(the opset 23 graph holds no Attention op)"
            )
        return VariantGraph(proto, {"ops": dict(_ops(proto))})
    with contextlib.redirect_stdout(io.StringIO()):
        if variant == "ort-fused":
            return _ort_fused(fp32)
        if variant == "int8":
            return _int8(fp32)
        if variant == "fp16":
            return _fp16(fp32)
        if variant == "ort-optimized":
            return _ort_optimized(fp32, provider)
    raise UsageError(f"unknown variant '{variant}' (known: {', '.join(VARIANTS)}, auto)")
