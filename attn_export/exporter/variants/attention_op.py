"""attention-op: the module re-exported at opset 23, where F.scaled_dot_product_attention
becomes the ONNX ``Attention`` op; a decoder's cache Concats become the op's past inputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attn_export.errors import ExportFailure
from attn_export.exporter.cache_in_op import declared_dims, fold_cache, fresh_prefixes, unfolded_cache
from attn_export.exporter.variants import VariantGraph, op_counts


def _mask_rows(proto: onnx.ModelProto) -> int:
    """Give every Attention mask one row per query, in place; how many masks it expanded.

    ONNX broadcasts the mask to ``[batch, heads, q_seq, total_seq]``, but ONNX Runtime's
    kernel refuses a mask whose axis -2 is not the query's length, such as the
    ``[batch, 1, 1, kv_seq]`` key padding mask ``nn.MultiheadAttention`` exports. A mask
    the graph declares with the query's length on that axis is left as it is; layers that
    share a mask and a query length share its expansion."""
    graph = proto.graph
    prefixes = fresh_prefixes(proto, "mask_rows")
    expanded: dict[tuple[str, object], str] = {}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and len(node.input) > 3 and node.input[3]:
            # the query's length is its axis -2 whether it is [batch, seq, hidden] or [batch, heads, seq, head_dim]
            query, mask = declared_dims(proto, node.input[0]), declared_dims(proto, node.input[3])
            known = len(query) >= 3 and query[-2] is not None
            if not (known and len(mask) >= 2 and mask[-2] == query[-2]):
                key = (node.input[3], query[-2] if known else node.input[0])
                if key not in expanded:
                    prefix = next(prefixes)
                    one = numpy_helper.from_array(np.array([1], np.int64), f"{prefix}/one")
                    graph.initializer.append(one)
                    new = [
                        helper.make_node("Shape", [node.input[0]], [f"{prefix}/q_seq"], start=-2, end=-1),
                        helper.make_node("Concat", [f"{prefix}/q_seq", one.name], [f"{prefix}/rows"], axis=0),
                        helper.make_node("Expand", [node.input[3], f"{prefix}/rows"], [f"{prefix}/mask"]),
                    ]
                    for added in new:  # traced, like the node they serve, to its source line
                        added.name = added.output[0]
                        added.metadata_props.extend(node.metadata_props)
                    nodes += new
                    expanded[key] = f"{prefix}/mask"
                node.input[3] = expanded[key]
        nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(nodes)
    return len(expanded)


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """``proto`` is already the opset-23 export; refuse it unless it holds an Attention op."""
    if "Attention" not in op_counts(proto):
        raise ExportFailure(
            "variant attention-op needs a module that calls F.scaled_dot_product_attention "
            "(the opset 23 graph holds no Attention op)"
        )
    folded = fold_cache(proto)
    unfolded = None if folded else unfolded_cache(proto)
    rows = _mask_rows(proto)
    info = {"ops": dict(op_counts(proto)), "cache_in_op": len(folded), "mask_rows_expanded": rows}
    stays = "the cache stays outside the Attention op, concatenated every step as in the plain export"
    return VariantGraph(proto, info, [f"{stays}: {unfolded}"] if unfolded else [])
