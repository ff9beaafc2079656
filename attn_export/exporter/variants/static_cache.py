"""static-cache: a decoder's cache as a fixed-capacity buffer that each step writes in place.

From the opset-23 export with the cache folded into the ``Attention`` op (as ``ort-past``),
each such node becomes ``com.microsoft.GroupQueryAttention`` reading its past up to the
graph input ``past_length``: the pasts are ``[batch, kv_heads, max_seq, head_dim]`` buffers,
the new tokens' keys and values are written at ``past_length`` and the presents are the
buffers again, of the same shape. Bound to one OrtValue, past and present are one buffer
(ONNX Runtime's ``past_present_share_buffer``, decided by their addresses): a step writes
only its new tokens, where a growing cache writes the whole present again. The interface
(``runtimes.static_cache.StaticCache``) is in the graph's metadata and the manifest.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from attn_export.artifacts.json_text import json_text
from attn_export.errors import ExportFailure
from attn_export.exporter.variants import VariantGraph, op_counts
from attn_export.exporter.variants.ort_past import GQA_LIMITS, _Nodes, _read, rewrite
from attn_export.model_spec import variant_chain
from attn_export.model_spec.cache import MASK
from attn_export.runtimes.static_cache import CAPACITY_DIM, LENGTH, METADATA_KEY, StaticCache


def _axis(bound: int) -> int:
    """A ``Shape`` start or end on the rank-4 buffer, counted from 0 and clamped as Slice clamps."""
    return min(max(bound + 4 if bound < 0 else bound, 0), 4)


def _filled_shapes(proto: onnx.ModelProto, past: str, attention: set[str]) -> None:
    """Every other node reading a past must be a ``Shape`` of it (the export reads the past's
    length so): it becomes the buffer's shape with axis 2 the filled length, no copy made,
    or the filled length alone where the ``Shape`` asks for axis 2 alone (one node a step,
    not six)."""
    readers = [n for n in proto.graph.node if past in n.input and n.name not in attention]
    for node in readers:
        if node.op_type != "Shape":
            raise ExportFailure(
                f"variant static-cache: node '{node.name}' ({node.op_type}) reads the past '{past}' "
                "itself; only its attention and its shape may"
            )
        nodes = _Nodes(f"{node.output[0]}/filled")
        one = nodes.const("one", np.array([1], np.int64))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        span = tuple(_axis(int(attrs.get(k, d))) for k, d in (("start", 0), ("end", 4)))
        if span == (2, 3):
            nodes.add("Reshape", [LENGTH, one], "length")
        else:
            whole = nodes.add("Shape", [past], "buffer_shape")
            parts = [
                nodes.add(
                    "Slice",
                    [whole, nodes.const("zero", np.array([0], np.int64)), nodes.const("two", np.array([2], np.int64))],
                    "lead",
                ),
                nodes.add("Reshape", [LENGTH, one], "length"),
                nodes.add(
                    "Slice",
                    [
                        whole,
                        nodes.const("three", np.array([3], np.int64)),
                        nodes.const("four", np.array([4], np.int64)),
                    ],
                    "tail",
                ),
            ]
            shape = nodes.add("Concat", parts, "shape", axis=0)
            if span != (0, 4):
                bounds = [nodes.const(k, np.array([v], np.int64)) for k, v in zip(("start", "end"), span, strict=True)]
                nodes.add("Slice", [shape, *bounds], "shape_part")
        nodes.nodes[-1].output[0] = node.output[0]
        at = list(proto.graph.node).index(node)
        proto.graph.node.remove(node)
        for i, new in enumerate(nodes.nodes):
            new.metadata_props.extend(node.metadata_props)
            proto.graph.node.insert(at + i, new)
        proto.graph.initializer.extend(nodes.constants)


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """``proto`` is the opset-23 export; refuse it unless an Attention op reads a cache."""
    graph = proto.graph
    if any(i.name == LENGTH for i in graph.input):
        raise ExportFailure(f"variant static-cache needs the input name '{LENGTH}' for itself; the graph has one")
    folded, kinds = rewrite(proto, "static-cache", LENGTH)
    pairs = tuple(
        (past, present)
        for op in folded
        for past, present in zip((op.past_key, op.past_value), op.node.output[1:3], strict=True)
    )
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    if not all(past in inputs and present in outputs for past, present in pairs):
        raise ExportFailure(
            "variant static-cache needs each cache's past to be a graph input and its present an output"
        )
    buffers = {n for pair in pairs for n in pair}
    for value in (*graph.input, *graph.output):
        if value.name in buffers:
            value.type.tensor_type.shape.dim[2].Clear()
            value.type.tensor_type.shape.dim[2].dim_param = CAPACITY_DIM
    graph.input.append(helper.make_tensor_value_info(LENGTH, TensorProto.INT64, []))
    attention = {n.name for n in graph.node if n.op_type == "GroupQueryAttention"}
    for past, _ in pairs:
        _filled_shapes(proto, past, attention)
    interface = StaticCache(pairs)
    info = {"cache_ops": kinds, "ops": dict(op_counts(proto)), "interface": interface.to_dict()}
    return VariantGraph(proto, info, [GQA_LIMITS], {METADATA_KEY: json_text(interface.to_dict(), indent=None, end="")})


def length_from_mask(proto: onnx.ModelProto, mask: str, ids: str) -> None:
    """``proto`` reading ``past_length`` from its own inputs, for a runner that feeds none
    (onnxruntime-genai): the mask covers the past and the new tokens, so the filled length
    is the mask's length less the ids'. Its interface metadata keeps the buffers, with no
    length to feed, so that verify drives the folder's graph as it drives the build's; a
    graph that records so already is left as it is (verify of the folder's own graph).
    ValueError where ``proto`` takes no such input."""
    graph = proto.graph
    static = StaticCache.from_metadata({p.key: p.value for p in proto.metadata_props})
    fed = next((i for i in graph.input if i.name == LENGTH), None)
    if fed is None and static is not None and static.length is None:
        return
    if fed is None or not {mask, ids} <= {i.name for i in graph.input}:
        raise ValueError(f"the graph takes no '{LENGTH}' beside '{mask}' and '{ids}' to derive it from")
    graph.input.remove(fed)
    if any(LENGTH in _read(node) for node in graph.node):  # gqa-rotary's graph reads the mask alone
        _derive_length(proto, mask, ids)
    if static is None:
        return
    for entry in proto.metadata_props:
        if entry.key == METADATA_KEY:  # the same buffers, with no length to feed
            entry.value = json_text(dataclasses.replace(static, length=None).to_dict(), indent=None, end="")


def _derive_length(proto: onnx.ModelProto, mask: str, ids: str) -> None:
    """``past_length`` computed first thing in ``proto``: the mask's length less the ids'."""
    graph = proto.graph
    nodes = _Nodes(f"{LENGTH}/from_mask")
    total = nodes.add("Shape", [mask], "total", start=1, end=2)
    new = nodes.add("Shape", [ids], "new", start=1, end=2)
    filled = nodes.add("Sub", [total, new], "filled")
    nodes.add("Squeeze", [filled, nodes.const("axis", np.array([0], np.int64))], "scalar")
    nodes.nodes[-1].output[0] = LENGTH
    for i, node in enumerate(nodes.nodes):
        graph.node.insert(i, node)
    graph.initializer.extend(nodes.constants)


def fed_by_genai(variant: str) -> Callable[[onnx.ModelProto], None] | None:
    """The edit that makes ``variant``'s graph one onnxruntime-genai feeds: a static-cache
    graph takes its filled length from the mask (``length_from_mask``); others need none."""
    if not variant_chain(variant).in_place:
        return None
    return functools.partial(length_from_mask, mask=MASK, ids="input_ids")
