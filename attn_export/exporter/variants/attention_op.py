"""attention-op: the module re-exported at opset 23, where F.scaled_dot_product_attention
becomes the ONNX ``Attention`` op; a decoder's cache Concats become the op's past inputs."""

from __future__ import annotations

import onnx

from attn_export.errors import ExportFailure
from attn_export.exporter.cache_in_op import fold_cache
from attn_export.exporter.variants import VariantGraph, op_counts


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """``proto`` is already the opset-23 export; refuse it unless it holds an Attention op."""
    if "Attention" not in op_counts(proto):
        raise ExportFailure(
            "variant attention-op needs a module that calls F.scaled_dot_product_attention "
            "(the opset 23 graph holds no Attention op)"
        )
    folded = fold_cache(proto)
    return VariantGraph(proto, {"ops": dict(op_counts(proto)), "cache_in_op": len(folded)})
