"""Rewrite every Softmax so a fully masked row gives a chosen result instead of what the
exporter's masking happens to give.

PyTorch's scaled_dot_product_attention uses a "safe" softmax: a row whose every score is
-inf gives weights of 0, so the attention output there is 0. Exported graphs fill masked
scores with -inf (ONNX Runtime then gives NaN) or with the float minimum (uniform weights:
the mean of V). The rewrites, each on its own copy of the graph:

- ``zero``: ``Where(ReduceMax(x) <= FULLY_MASKED, 0, Softmax(x))``, PyTorch's safe softmax;
- ``uniform``: ``Softmax(Where(ReduceMax(x) <= FULLY_MASKED, 0, x))``, the mean of V.

ONNX Runtime's fused ``MultiHeadAttention`` (the ort-fused variant) is rewritten alike where
it takes an additive bias: the row test reads the bias, and ``zero`` zeroes the op's output
for each head whose row sees no key, ``uniform`` fills the bias row with the lowest float.
So is the ONNX ``Attention`` op (the attention-op variant) with a float mask and a 4-D
query: ``zero`` zeroes its output there, ``uniform`` zeroes that row's query and mask.

A row counts as fully masked when its largest score is at most ``FULLY_MASKED`` (-1e8):
every masking fill in use (-inf, the float minimum, the -1e9 of hand-written masked_fill)
is below it, and no real attention score comes near it. float16 cannot hold -1e8 (it
becomes -inf, which a fill clamped to float16's lowest, -65504, never reaches), so the
rows of a Softmax whose scores are float16, or were until a Cast, are judged against
``FULLY_MASKED_HALF`` (-3e4) instead.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from attn_export.artifacts.onnx_file import default_opset
from attn_export.exporter.cache_in_op import attribute

__all__ = ["FULLY_MASKED", "FULLY_MASKED_HALF", "REWRITES", "rewrite_softmax"]

FULLY_MASKED = -1e8
FULLY_MASKED_HALF = -3e4
#: The lowest finite float32 and float16: a bias row of it gives uniform weights.
_LOWEST, _HALF_LOWEST = -3.4028234663852886e38, -65504.0
#: Marks the names of the values a rewrite adds.
_MARK = ".fully_masked."
#: Rewrite name -> what a fully masked row then gives.
REWRITES = {"zero": "0", "uniform": "mean of V"}


def _reduce_max(x: str, axis: int, out: str, axes_name: str, opset: int) -> list[onnx.NodeProto]:
    if opset >= 18:
        return [
            helper.make_node("Constant", [], [axes_name], value=helper.make_tensor("", TensorProto.INT64, [1], [axis])),
            helper.make_node("ReduceMax", [x, axes_name], [out], keepdims=1),
        ]
    return [helper.make_node("ReduceMax", [x], [out], axes=[axis], keepdims=1)]


#: ONNX Runtime's fused attention, rewritten where it takes an additive bias (input 5).
_FUSED = ("com.microsoft", "MultiHeadAttention")
_BIAS = 5
#: The ONNX Attention op's mask input.
_MASK = 3


def _scores(node: onnx.NodeProto) -> int | None:
    """The input a rewrite's row test reads: a Softmax's scores, the fused op's bias, the
    ONNX Attention op's mask (where it has no causal flag of its own); None for any other
    node, which is not rewritten."""
    onnx_domain = node.domain in ("", "ai.onnx")
    if node.op_type == "Softmax" and onnx_domain:
        return 0
    if (node.domain, node.op_type) == _FUSED and len(node.input) > _BIAS and node.input[_BIAS]:
        return _BIAS
    if node.op_type == "Attention" and onnx_domain and len(node.input) > _MASK and node.input[_MASK]:
        return None if attribute(node, "is_causal", 0) else _MASK
    return None


def _undo(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with an earlier rewrite taken out, so rewriting a repaired graph starts
    from the exporter's Softmax (or attention op) again."""
    produced = {o: n for n in nodes for o in n.output}
    kept = []
    for node in nodes:
        if _scores(node) is not None:
            node.output[0] = node.output[0].removesuffix(f"{_MARK}weights").removesuffix(f"{_MARK}attended")
            for i, name in enumerate(node.input):
                if name.endswith((f"{_MARK}scores", f"{_MARK}query")):
                    node.input[i] = produced[name].input[2]
        elif any(_MARK in o for o in node.output) or (node.op_type == "Where" and _MARK in node.input[2]):
            continue  # the row test, uniform's Where, zero's Where
        kept.append(node)
    return kept


def _row_test(x: str, axis: int, p: str, limit: float, opset: int) -> list[onnx.NodeProto]:
    """``{p}rows``: True where ``x``'s largest score along ``axis`` is at most ``limit``;
    ``{p}zero``: a 0 of ``x``'s type."""
    return [
        *_reduce_max(x, axis, f"{p}max", f"{p}axes", opset),
        helper.make_node("Constant", [], [f"{p}limit_f"], value=helper.make_tensor("", TensorProto.FLOAT, [], [limit])),
        helper.make_node("Constant", [], [f"{p}zero_f"], value=helper.make_tensor("", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("CastLike", [f"{p}limit_f", x], [f"{p}limit"]),
        helper.make_node("CastLike", [f"{p}zero_f", x], [f"{p}zero"]),
        helper.make_node("LessOrEqual", [f"{p}max", f"{p}limit"], [f"{p}rows"]),
    ]


def _softmax(node: onnx.NodeProto, mode: str, p: str) -> list[onnx.NodeProto]:
    """The Softmax's rewrite after its row test: its weights zeroed, or its scores."""
    softmax = onnx.NodeProto()
    softmax.CopyFrom(node)
    x, y = node.input[0], node.output[0]
    if mode == "zero":
        softmax.output[0] = f"{p}weights"
        return [softmax, helper.make_node("Where", [f"{p}rows", f"{p}zero", f"{p}weights"], [y])]
    softmax.input[0] = f"{p}scores"
    return [helper.make_node("Where", [f"{p}rows", f"{p}zero", x], [f"{p}scores"]), softmax]


def _fused_attention(node: onnx.NodeProto, mode: str, p: str, lowest: float) -> list[onnx.NodeProto]:
    """The fused op's rewrite after the row test of its bias ``[batch, heads or 1, seq,
    keys]``: its bias rows set to ``lowest``, which swamps every score alike (uniform
    weights; a zero bias would unmask the row instead), or its output ``[batch, seq, heads
    * head_dim]`` zeroed per head where that head's row sees no key."""
    op = onnx.NodeProto()
    op.CopyFrom(node)
    if mode == "uniform":
        bias = node.input[_BIAS]
        op.input[_BIAS] = f"{p}scores"
        value = helper.make_tensor("", TensorProto.FLOAT, [], [lowest])
        return [
            helper.make_node("Constant", [], [f"{p}lowest_f"], value=value),
            helper.make_node("CastLike", [f"{p}lowest_f", bias], [f"{p}lowest"]),
            helper.make_node("Where", [f"{p}rows", f"{p}lowest", bias], [f"{p}scores"]),
            op,
        ]
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    op.output[0] = f"{p}attended"
    split = helper.make_tensor("", TensorProto.INT64, [4], [0, 0, heads, -1])
    return [
        op,
        helper.make_node("Constant", [], [f"{p}split_shape"], value=split),
        helper.make_node("Reshape", [f"{p}attended", f"{p}split_shape"], [f"{p}split"]),
        helper.make_node("Transpose", [f"{p}rows"], [f"{p}token_rows"], perm=[0, 2, 1, 3]),
        helper.make_node("Shape", [f"{p}split"], [f"{p}split_dims"]),
        helper.make_node("Expand", [f"{p}token_rows", f"{p}split_dims"], [f"{p}head_rows"]),
        helper.make_node("Shape", [f"{p}attended"], [f"{p}dims"]),
        helper.make_node("Reshape", [f"{p}head_rows", f"{p}dims"], [f"{p}out_rows"]),
        helper.make_node("Where", [f"{p}out_rows", f"{p}zero", f"{p}attended"], [node.output[0]]),
    ]


def _onnx_attention(node: onnx.NodeProto, mode: str, p: str) -> list[onnx.NodeProto]:
    """The ONNX Attention op's rewrite after the row test of its additive mask, for a
    ``[batch, heads, seq, head_dim]`` query: its output zeroed where a head's row sees no
    key, or that row's query and mask zeroed, so every score is 0 (uniform weights: a
    runtime may treat the lowest float in a mask as no key at all)."""
    op = onnx.NodeProto()
    op.CopyFrom(node)
    if mode == "zero":
        op.output[0] = f"{p}attended"
        return [op, helper.make_node("Where", [f"{p}rows", f"{p}zero", f"{p}attended"], [node.output[0]])]
    op.input[0], op.input[_MASK] = f"{p}query", f"{p}scores"
    return [
        helper.make_node("Where", [f"{p}rows", f"{p}zero", node.input[0]], [f"{p}query"]),
        helper.make_node("Where", [f"{p}rows", f"{p}zero", node.input[_MASK]], [f"{p}scores"]),
        op,
    ]


def rewrite_softmax(proto: onnx.ModelProto, mode: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``proto`` with every Softmax of the main graph, every ONNX Runtime
    MultiHeadAttention that takes an additive bias and every ONNX Attention op with a float
    mask rewritten (``mode`` is a key of ``REWRITES``), and how many were; 0 where the graph
    has none it can rewrite (opsets before 13, whose Softmax flattens, or attention done by
    another fused op)."""
    if mode not in REWRITES:
        raise ValueError(f"unknown rewrite {mode!r}")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    opset = default_opset(out) or 0
    if opset < 15:  # Softmax over the last axis needs 13, CastLike 15
        return out, 0
    nodes: list[onnx.NodeProto] = []
    count = 0
    original = _undo(list(out.graph.node))
    if all(_scores(n) is None for n in original):
        return out, 0
    typed = onnx.shape_inference.infer_shapes(out)
    graph = typed.graph
    values = (*graph.input, *graph.value_info, *graph.output)
    types = {v.name: v.type.tensor_type.elem_type for v in values}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    producers = {o: n for n in out.graph.node for o in n.output}

    def passed_half(name: str) -> bool:
        """Whether ``name`` is float16, or was before a Cast."""
        while types.get(name) != TensorProto.FLOAT16 and name in producers and producers[name].op_type == "Cast":
            name = producers[name].input[0]
        return types.get(name) == TensorProto.FLOAT16

    for node in original:
        scores = _scores(node)
        if scores == _MASK and (ranks.get(node.input[0]) != 4 or types.get(node.input[_MASK]) == TensorProto.BOOL):
            scores = None  # an Attention op is rewritten only with a float mask and a 4-D query
        if scores is None:
            nodes.append(node)
            continue
        x = node.input[scores]
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1) if scores == 0 else -1
        p = f"{node.output[0]}{_MARK}"
        limit, lowest = (FULLY_MASKED_HALF, _HALF_LOWEST) if passed_half(x) else (FULLY_MASKED, _LOWEST)
        if scores == 0:
            rewritten = _softmax(node, mode, p)
        elif scores == _BIAS:
            rewritten = _fused_attention(node, mode, p, lowest)
        else:
            rewritten = _onnx_attention(node, mode, p)
        new = _row_test(x, axis, p, limit, opset) + rewritten
        for k, added in enumerate(new):
            if added.op_type != node.op_type:  # the repair is part of the node's FX node and source line
                added.name = f"{node.name or node.output[0]}{_MARK}{k}"
                added.metadata_props.extend(node.metadata_props)
        nodes += new
        count += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, count
