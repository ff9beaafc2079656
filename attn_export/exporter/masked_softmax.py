"""Rewrite every Softmax so a fully masked row gives a chosen result instead of what the
exporter's masking happens to give.

PyTorch's scaled_dot_product_attention uses a "safe" softmax: a row whose every score is
-inf gives weights of 0, so the attention output there is 0. Exported graphs fill masked
scores with -inf (ONNX Runtime then gives NaN) or with the float minimum (uniform weights:
the mean of V). The rewrites, each on its own copy of the graph:

- ``zero``: ``Where(ReduceMax(x) <= FULLY_MASKED, 0, Softmax(x))``, PyTorch's safe softmax;
- ``uniform``: ``Softmax(Where(ReduceMax(x) <= FULLY_MASKED, 0, x))``, the mean of V.

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

__all__ = ["FULLY_MASKED", "FULLY_MASKED_HALF", "REWRITES", "rewrite_softmax"]

FULLY_MASKED = -1e8
FULLY_MASKED_HALF = -3e4
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


def _undo(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with an earlier rewrite taken out, so rewriting a repaired graph starts
    from the exporter's Softmax again."""
    produced = {o: n for n in nodes for o in n.output}
    kept = []
    for node in nodes:
        if node.op_type == "Softmax":
            node.output[0] = node.output[0].removesuffix(f"{_MARK}weights")
            if node.input[0].endswith(f"{_MARK}scores"):
                node.input[0] = produced[node.input[0]].input[2]
        elif any(_MARK in o for o in node.output) or (node.op_type == "Where" and _MARK in node.input[2]):
            continue  # the row test, uniform's Where, zero's Where
        kept.append(node)
    return kept


def rewrite_softmax(proto: onnx.ModelProto, mode: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``proto`` with every Softmax of the main graph rewritten (``mode`` is a key
    of ``REWRITES``), and how many were; 0 where the graph has none it can rewrite (opsets
    before 13, whose Softmax flattens, or attention done by a fused op)."""
    if mode not in REWRITES:
        raise ValueError(f"unknown rewrite {mode!r}")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    opset = default_opset(out) or 0
    if opset < 15:  # Softmax over the last axis needs 13, CastLike 15
        return out, 0
    nodes: list[onnx.NodeProto] = []
    count = 0
    typed = onnx.shape_inference.infer_shapes(out)
    types = {v.name: v.type.tensor_type.elem_type for v in (*typed.graph.input, *typed.graph.value_info)}
    producers = {o: n for n in out.graph.node for o in n.output}

    def computed_in(name: str) -> int | None:
        """The element type ``name`` was computed in, before any Cast."""
        while name in producers and producers[name].op_type == "Cast":
            name = producers[name].input[0]
        return types.get(name)

    for node in _undo(list(out.graph.node)):
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        x, y = node.input[0], node.output[0]
        p = f"{y}{_MARK}"
        limit = FULLY_MASKED_HALF if computed_in(x) == TensorProto.FLOAT16 else FULLY_MASKED
        new = [
            *_reduce_max(x, axis, f"{p}max", f"{p}axes", opset),
            helper.make_node(
                "Constant", [], [f"{p}limit_f"], value=helper.make_tensor("", TensorProto.FLOAT, [], [limit])
            ),
            helper.make_node(
                "Constant", [], [f"{p}zero_f"], value=helper.make_tensor("", TensorProto.FLOAT, [], [0.0])
            ),
            helper.make_node("CastLike", [f"{p}limit_f", x], [f"{p}limit"]),
            helper.make_node("CastLike", [f"{p}zero_f", x], [f"{p}zero"]),
            helper.make_node("LessOrEqual", [f"{p}max", f"{p}limit"], [f"{p}rows"]),
        ]
        softmax = onnx.NodeProto()
        softmax.CopyFrom(node)
        if mode == "zero":
            softmax.output[0] = f"{p}weights"
            new += [softmax, helper.make_node("Where", [f"{p}rows", f"{p}zero", f"{p}weights"], [y])]
        else:
            softmax.input[0] = f"{p}scores"
            new += [helper.make_node("Where", [f"{p}rows", f"{p}zero", x], [f"{p}scores"]), softmax]
        for k, added in enumerate(new):
            if added is not softmax:  # the repair is part of the softmax's FX node and source line
                added.name = f"{node.name or y}{_MARK}{k}"
                added.metadata_props.extend(node.metadata_props)
        nodes += new
        count += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, count
