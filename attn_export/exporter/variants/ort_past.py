"""ort-past: a decoder's attention with its cache as ONNX Runtime's own cache ops.

From the opset-23 export with the cache folded into the ``Attention`` op, each such node
becomes ``com.microsoft.MultiHeadAttention`` (as many key/value heads as query heads) or
``com.microsoft.GroupQueryAttention`` (fewer), both with ``past_key``/``past_value`` inputs:
the append to the cache runs inside the kernel. The mask goes in as ``attention_bias``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attn_export.errors import ExportFailure
from attn_export.exporter.cache_in_op import (
    CacheAttention,
    attribute,
    declared_dims,
    fold_cache,
    fresh_prefixes,
    unfolded_cache,
    value_info,
)
from attn_export.exporter.packed_projections import pack
from attn_export.exporter.variants import VariantGraph, op_counts

#: What ONNX Runtime's GroupQueryAttention cannot run, said where the variant is built.
GQA_LIMITS = (
    "GroupQueryAttention is always causal (aligned to the end of the keys: a module that is not "
    "fails verify wherever seq > 1), runs several new tokens on a non-empty cache only at batch 1 "
    "(ONNX Runtime refuses such inputs), and on CUDA only in float16"
)


def _heads(proto: onnx.ModelProto, name: str) -> int:
    """The static head count (dim 1) of a ``[batch, heads, seq, head_dim]`` tensor."""
    info = value_info(proto, name)
    dims = info.shape.dim if info is not None else []
    if len(dims) == 4 and dims[1].HasField("dim_value"):
        return int(dims[1].dim_value)
    raise ExportFailure(f"variant ort-past needs a static head count for '{name}' (the graph declares none)")


def _dtype(proto: onnx.ModelProto, name: str) -> np.dtype:
    info = value_info(proto, name)
    return np.dtype(helper.tensor_dtype_to_np_dtype(info.elem_type if info is not None else TensorProto.FLOAT))


class _Nodes:
    """New nodes and constants, named after the attention node they serve."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        full = f"{self.prefix}/{name}"
        if all(c.name != full for c in self.constants):
            self.constants.append(numpy_helper.from_array(value, full))
        return full

    def add(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs: Any) -> str:
        out = f"{self.prefix}/{name}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, domain=domain, **attrs))
        return out

    def to_bsh(self, name: str, label: str) -> str:
        """``[batch, heads, seq, head_dim]`` to ``[batch, seq, heads * head_dim]``."""
        moved = self.add("Transpose", [name], f"{label}_bsnh", perm=[0, 2, 1, 3])
        return self.add("Reshape", [moved, self.const("bsh_shape", np.array([0, 0, -1], np.int64))], f"{label}_bsh")


def _merged_heads(proto: onnx.ModelProto, name: str, producers: dict[str, onnx.NodeProto]) -> str | None:
    """The ``[batch, seq, heads * head_dim]`` tensor whose heads ``name`` only splits out
    (a Reshape to ``[batch, seq, heads, head_dim]`` and a Transpose, as a module turns its
    projection into heads), or None. The contrib ops read that tensor as it is: no layout
    ops each step."""
    moved = producers.get(name)
    if moved is None or moved.op_type != "Transpose" or attribute(moved, "perm", []) != [0, 2, 1, 3]:
        return None
    split = producers.get(moved.input[0])
    if split is None or split.op_type != "Reshape":
        return None
    merged, heads = declared_dims(proto, split.input[0]), declared_dims(proto, split.output[0])
    if len(merged) != 3 or len(heads) != 4 or None in (*merged, *heads):
        return None
    same_lead = merged[:2] == heads[:2]
    sizes = [d for d in (merged[2], heads[2], heads[3]) if isinstance(d, int)]
    return split.input[0] if same_lead and len(sizes) == 3 and sizes[0] == sizes[1] * sizes[2] else None


def _bias(nodes: _Nodes, proto: onnx.ModelProto, op: CacheAttention) -> tuple[str, str]:
    """The op's mask as the additive ``[batch or 1, heads or 1, seq, total]`` bias the
    contrib ops take (a boolean mask becomes 0 / the dtype's minimum), and a
    ``[.., seq, 1]`` bool that is False on query rows the mask leaves no key: the ONNX op
    gives 0 there, the contrib ops the mean of V or NaN. A mask of rank 2 or 3 broadcasts
    from the right, as the ONNX op reads it: ``[seq, total]``, ``[heads or 1, seq, total]``."""
    mask = value_info(proto, op.mask)
    rank = len(mask.shape.dim) if mask is not None and mask.HasField("shape") else None
    if mask is None or rank not in (2, 3, 4):
        raise ExportFailure("variant ort-past needs an attention mask of known rank 2, 3 or 4 ([..., seq, total])")
    full = op.mask
    if rank != 4:
        full = nodes.add("Unsqueeze", [op.mask, nodes.const(f"rank{rank}_axes", np.arange(4 - rank))], "mask_4d")
    dtype = _dtype(proto, op.query)
    axis = nodes.const("last_axis", np.array([-1], np.int64))
    if mask.elem_type == TensorProto.BOOL:
        zero = nodes.const("zero", np.zeros((), dtype))
        bias = nodes.add("Where", [full, zero, nodes.const("lowest", np.array(np.finfo(dtype).min, dtype))], "bias")
        seen = nodes.add("ReduceMax", [nodes.add("Cast", [full], "mask_i32", to=TensorProto.INT32), axis], "seen")
        return bias, nodes.add("Greater", [seen, nodes.const("none", np.zeros((), np.int32))], "has_key")
    top = nodes.add("ReduceMax", [full, axis], "top")
    none = nodes.const("none", np.array(-np.inf, helper.tensor_dtype_to_np_dtype(mask.elem_type)))
    return full, nodes.add("Greater", [top, none], "has_key")


def _lengths(nodes: _Nodes, op: CacheAttention, query: str, key: str, length: str | None) -> tuple[str, str]:
    """GroupQueryAttention's ``seqlens_k`` (total - 1 for every row, padding being in the
    bias) and ``total_sequence_length``: the new keys' length (axis 1 of ``key``,
    ``[batch, seq, hidden]`` as the op reads it) plus the past's, which is the past's
    shape, or the input ``length`` for a buffer filled up to there."""
    if length is None:
        past = nodes.add("Shape", [op.past_key], "past_len", start=2, end=3)
    else:
        past = nodes.add("Reshape", [length, nodes.const("one_dim", np.array([1], np.int64))], "past_len")
    new = nodes.add("Shape", [key], "new_len", start=1, end=2)
    total = nodes.add("Cast", [nodes.add("Add", [past, new], "total_i64")], "total_1", to=TensorProto.INT32)
    scalar = nodes.add("Squeeze", [total], "total")
    last = nodes.add("Sub", [total, nodes.const("one", np.array([1], np.int32))], "last")
    batch = nodes.add("Shape", [query], "batch", start=0, end=1)
    return nodes.add("Expand", [last, batch], "seqlens_k"), scalar


def _replace(
    proto: onnx.ModelProto,
    op: CacheAttention,
    prefix: str,
    length: str | None,
    producers: dict[str, onnx.NodeProto],
) -> tuple[list[onnx.NodeProto], str]:
    """The nodes standing in for one folded Attention node, and the contrib op they use:
    GroupQueryAttention wherever ``length`` names the filled length of a buffer (the only
    one of the two that reads a buffer up to a length)."""
    node = op.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("softcap", 0.0) or attrs.get("qk_matmul_output_mode", 0):
        raise ExportFailure("variant ort-past cannot express an Attention op with softcap or score outputs")
    heads, kv_heads = _heads(proto, op.query), _heads(proto, op.past_key)
    nodes = _Nodes(prefix)
    merged = [_merged_heads(proto, name, producers) for name in (op.query, op.new_key, op.new_value)]
    kind = "MultiHeadAttention" if heads == kv_heads and length is None else "GroupQueryAttention"
    whole = [name for name in merged if name is not None]
    packed = pack(proto, whole, prefix) if kind == "GroupQueryAttention" and len(whole) == 3 else None
    projection: list[onnx.NodeProto] = []  # one MatMul standing for three: a fused region, untraced
    if packed is not None:  # the op reads the three projections packed
        (query, projection), key, value = packed, "", ""
    else:
        query, key, value = (
            name or nodes.to_bsh(source, label)
            for name, source, label in zip(merged, (op.query, op.new_key, op.new_value), "qkv", strict=True)
        )
    bias, has_key = _bias(nodes, proto, op) if op.mask else ("", "")
    scale = {"scale": attrs["scale"]} if "scale" in attrs else {}
    y = f"{nodes.prefix}/y_bsh"
    if kind == "MultiHeadAttention":
        inputs = [query, key, value, "", "", bias, op.past_key, op.past_value]
        extra: dict[str, Any] = {}
    else:
        seqlens, total = _lengths(nodes, op, query, key or query, length)
        inputs = [query, key, value, op.past_key, op.past_value, seqlens, total, "", "", "", bias]
        extra = {"kv_num_heads": kv_heads}
    nodes.nodes.append(
        helper.make_node(
            kind,
            inputs,
            [y, *node.output[1:3]],
            name=f"{nodes.prefix}/{kind}",
            domain="com.microsoft",
            num_heads=heads,
            **scale,
            **extra,
        )
    )
    split = nodes.add("Reshape", [y, nodes.const("bsnh_shape", np.array([0, 0, heads, -1], np.int64))], "y_bsnh")
    back = nodes.add("Transpose", [split], "y", perm=[0, 2, 1, 3])
    if has_key:
        back = nodes.add("Where", [has_key, back, nodes.const("zero", np.zeros((), _dtype(proto, op.query)))], "y_seen")
    nodes.nodes[-1].output[0] = node.output[0]
    for new in nodes.nodes:  # traced, like the node they replace, to its FX node and source line
        new.metadata_props.extend(node.metadata_props)
    proto.graph.initializer.extend(nodes.constants)
    return [*projection, *nodes.nodes], kind


def _read(node: onnx.NodeProto) -> Iterator[str]:
    """The names ``node`` reads, its subgraphs' reads of outer names included (a subgraph
    output may name an outer value directly)."""
    yield from node.input
    for attr in node.attribute:
        for graph in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
            yield from (o.name for o in graph.output)
            for inner in graph.node:
                yield from _read(inner)


def keep_live(proto: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    """``proto``'s nodes become ``nodes`` without the dead ones (``_live``), its constants
    those a node, input or output still reads."""
    graph = proto.graph
    outputs = {o.name for o in graph.output}
    graph.ClearField("node")
    graph.node.extend(_live(nodes, outputs))
    read = {name for node in graph.node for name in _read(node)} | {i.name for i in graph.input} | outputs
    constants = [c for c in graph.initializer if c.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(constants)


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` without those whose every output nobody reads: the layout ops a module
    split its heads with, once the contrib op reads the projection itself. ONNX Runtime
    runs a dead node every step all the same."""
    while True:
        read = outputs | {name for node in nodes for name in _read(node)}
        kept = [n for n in nodes if any(o in read for o in n.output if o)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def rewrite(proto: onnx.ModelProto, variant: str, length: str | None = None) -> tuple[list[CacheAttention], list[str]]:
    """Replace, in place, each Attention op reading a cache by a contrib op with past inputs;
    the ops folded and the contrib ops used. ``proto`` is the opset-23 export; ExportFailure
    naming ``variant`` unless an Attention op reads a cache. With ``length`` (an input's
    name), every op is GroupQueryAttention reading its past up to that length."""
    folded = fold_cache(proto)
    if not folded:
        why = unfolded_cache(proto)
        raise ExportFailure(
            f"variant {variant} needs a decoder whose cache Concat(past, new) feeds "
            "F.scaled_dot_product_attention without is_causal ("
            + (f"here {why}" if why else "the opset 23 graph has no such Attention op")
            + ")"
        )
    graph = proto.graph
    prefixes = fresh_prefixes(proto, "ort_past")
    producers = {out: n for n in graph.node for out in n.output}
    replaced = {op.node.output[0]: _replace(proto, op, next(prefixes), length, producers) for op in folded}
    keep_live(
        proto,
        [n for node in graph.node for n in (replaced[node.output[0]][0] if node.output[0] in replaced else [node])],
    )
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return folded, sorted({kind for _, kind in replaced.values()})


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """``proto`` is the opset-23 export; refuse it unless an Attention op reads a cache."""
    _, kinds = rewrite(proto, "ort-past")
    result = VariantGraph(proto, {"cache_ops": kinds, "ops": dict(op_counts(proto))})
    if "GroupQueryAttention" in kinds:
        result.warnings.append(GQA_LIMITS)
    return result
