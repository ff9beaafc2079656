"""ort-fused: onnxscript's ``optimize_for_ort`` after simplifying the exporter's dim
expressions, which lets attention fuse into ``com.microsoft.MultiHeadAttention``."""

from __future__ import annotations

import logging
import re
import warnings

import onnx

from attn_export._deps import require
from attn_export.exporter.variants import ATTENTION_OPS, VariantGraph, op_counts


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


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    ir = require("onnx_ir", "the ort-fused variant")
    ort_fusions = require("onnxscript.rewriter.ort_fusions", "the ort-fused variant")
    model = ir.serde.deserialize_model(_simplify_dims(proto))
    optimizer = logging.getLogger("onnxscript")  # says on stderr which folds it skips
    level = optimizer.level
    optimizer.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused, counts = ort_fusions.optimize_for_ort(model)
    finally:
        optimizer.setLevel(level)
    out = ir.serde.serialize_model(fused)
    ops = op_counts(out)
    result = VariantGraph(out, {"fusions": {k: v for k, v in counts.items() if v}, "ops": dict(ops)})
    if not set(ops) & ATTENTION_OPS:
        result.warnings.append("no attention fusion applied; the graph is the fp32 one with minor rewrites")
    return result
