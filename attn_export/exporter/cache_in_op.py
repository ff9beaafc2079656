"""Move a decoder's key/value cache into the ONNX ``Attention`` op (opset 23).

A decoder on ``F.scaled_dot_product_attention`` exports as ``Concat(past, new)`` along the
sequence axis feeding the op's key and value, the Concat's output being the present. The
op has inputs for exactly that (``past_key``/``past_value``, outputs ``present_key``/
``present_value``), which lets a runtime append to the cache inside its kernel and lets
ONNX Runtime's own cache ops (``com.microsoft.MultiHeadAttention``/``GroupQueryAttention``)
take the node over.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
from onnx import helper

from attn_export.exporter.stack import innermost_line

__all__ = [
    "CacheAttention",
    "attribute",
    "declared_dims",
    "fold_cache",
    "fresh_prefixes",
    "unfolded_cache",
    "value_info",
]


@dataclass(frozen=True)
class CacheAttention:
    """One Attention node whose cache was folded in, and its inputs in the op's order."""

    node: onnx.NodeProto
    query: str
    new_key: str
    new_value: str
    mask: str  # "" without one
    past_key: str
    past_value: str


def value_info(proto: onnx.ModelProto, name: str) -> onnx.TypeProto.Tensor | None:
    """The type the graph declares for tensor ``name`` (input, value_info or output)."""
    graph = proto.graph
    return next((i.type.tensor_type for i in (*graph.input, *graph.value_info, *graph.output) if i.name == name), None)


def declared_dims(proto: onnx.ModelProto, name: str) -> list[str | int | None]:
    """The graph's declared dims of ``name`` (a symbol, a size or None each); [] if none."""
    info = value_info(proto, name)
    dims = info.shape.dim if info is not None and info.HasField("shape") else []
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in dims]


def _seq_dim(proto: onnx.ModelProto, name: str) -> str | int | None:
    """Axis 2 of a rank-4 tensor as the graph declares it (a symbol or a size), or None."""
    dims = declared_dims(proto, name)
    return dims[2] if len(dims) == 4 else None


def fresh_prefixes(proto: onnx.ModelProto, stem: str) -> Iterator[str]:
    """Name prefixes ``{stem}_0``, ``{stem}_1``, ... for new nodes and tensors (named
    ``prefix/...``) that no name in the graph starts with."""
    graph = proto.graph
    names = {n for node in graph.node for n in (node.name, *node.output)}
    names |= {i.name for i in (*graph.input, *graph.initializer)}
    heads = {n.split("/", 1)[0] for n in names}
    return (p for p in (f"{stem}_{i}" for i in itertools.count()) if p not in heads)


def attribute(node: onnx.NodeProto, name: str, default: object) -> object:
    """The value of ``node``'s attribute ``name``, or ``default``."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _cache_concat(
    proto: onnx.ModelProto, name: str, query: str, producers: dict[str, onnx.NodeProto], uses: dict[str, int]
) -> onnx.NodeProto | None:
    """The node making ``name`` if it is ``Concat(past, new)`` on the sequence axis of a
    rank-4 ``[batch, heads, seq, head_dim]`` tensor read only by the attention (and the
    graph's outputs). The past must be a graph input whose length is not the query's; the
    new keys, where the graph says, as long as the query: ``cat(new, past)`` is never taken
    for ``cat(past, new)``."""
    node = producers.get(name)
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    inputs = {i.name for i in proto.graph.input}
    q_len, past_len, new_len = (_seq_dim(proto, n) for n in (query, *node.input))
    if node.input[0] not in inputs or (q_len is not None and past_len == q_len):
        return None
    known = None not in (new_len, q_len)
    if (known and new_len != q_len) or (node.input[1] in inputs and not known):
        return None  # two graph inputs: only their declared lengths tell the past from the new keys
    if attribute(node, "axis", None) not in (2, -2) or len(declared_dims(proto, node.input[0])) != 4:
        return None
    return node if uses.get(name, 0) == 1 else None


def _unrepeated(
    proto: onnx.ModelProto, name: str, producers: dict[str, onnx.NodeProto], uses: dict[str, int]
) -> tuple[str, list[onnx.NodeProto]]:
    """Where ``name`` only repeats a cache's key/value heads for grouped-query attention
    (Hugging Face's ``repeat_kv``: an Unsqueeze at axis 2, an Expand of that axis, a Reshape
    merging it into the heads), the tensor it repeats and those three nodes; else ``name``
    and none. The Attention op groups the query heads over fewer key/value heads itself, as
    ``repeat_kv`` does (head ``h`` reads key/value head ``h // repeats``)."""
    reshape = producers.get(name)
    expand = producers.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
    lift = producers.get(expand.input[0]) if expand is not None and expand.op_type == "Expand" else None
    if lift is None or lift.op_type != "Unsqueeze" or reshape is None or expand is None:
        return name, []
    outputs = {o.name for o in proto.graph.output}
    if any(uses.get(n.output[0], 0) != 1 or n.output[0] in outputs for n in (lift, expand, reshape)):
        return name, []
    source = lift.input[0]
    values = (source, lift.output[0], expand.output[0], name)
    cache, lifted, repeated, merged = (declared_dims(proto, n) for n in values)
    if len(cache) != 4 or len(repeated) != 5 or None in (*cache, *repeated, *merged):
        return name, []
    heads, times = repeated[1], repeated[2]
    if not isinstance(heads, int) or not isinstance(times, int):
        return name, []
    fits = lifted == [*cache[:2], 1, *cache[2:]] and repeated[:2] == cache[:2] and repeated[3:] == cache[2:]
    return (source, [lift, expand, reshape]) if fits and merged == [cache[0], heads * times, *cache[2:]] else (name, [])


def fold_cache(proto: onnx.ModelProto) -> list[CacheAttention]:
    """Fold each cache Concat pair into the Attention op it feeds, in place; the nodes folded.

    Left alone: an op with ``is_causal=1`` (its causal mask is aligned top-left over the
    concatenated keys; with past inputs the op aligns it differently), one that already has
    past inputs or returns its scores, and keys or values that other nodes also read. A
    repeat of the cache's key/value heads between the Concat and the op (``_unrepeated``)
    is folded away with it: the op reads the cache with its own heads."""
    graph = proto.graph
    producers = {out: node for node in graph.node for out in node.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    folded = []
    for node in graph.node:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.input) > 4:
            continue
        if attribute(node, "is_causal", 0) or len(node.output) > 1:
            continue
        (key_source, key_repeat), (value_source, value_repeat) = (
            _unrepeated(proto, name, producers, uses) for name in node.input[1:3]
        )
        key, value = (_cache_concat(proto, n, node.input[0], producers, uses) for n in (key_source, value_source))
        if key is None or value is None or key is value:
            continue
        repeats = [declared_dims(proto, r[-1].output[0])[1] if r else None for r in (key_repeat, value_repeat)]
        if len(set(repeats)) != 1 or declared_dims(proto, key_source)[1:2] != declared_dims(proto, value_source)[1:2]:
            continue  # keys and values repeated alike (or neither), from caches of as many heads
        mask = node.input[3] if len(node.input) > 3 else ""
        node.input[:] = [node.input[0], key.input[1], value.input[1], mask, key.input[0], value.input[0]]
        node.output.extend((key_source, value_source))
        for folded_node in (key, value, *key_repeat, *value_repeat):
            graph.node.remove(folded_node)
        folded.append(CacheAttention(node, *node.input))
    return folded


def _named(node: onnx.NodeProto) -> str:
    """``node`` as a message names it: op, name and the module's source line where known."""
    stack = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.stack_trace"), "")
    line = innermost_line(stack)
    return f"{node.op_type} node '{node.name}'" + (f" ({line[0]} `{line[1]}`)" if line else "")


def unfolded_cache(proto: onnx.ModelProto) -> str | None:
    """Why a graph that concatenates a cache input (``Concat`` of a rank-4 graph input) kept
    it out of its Attention op, as ``fold_cache`` left it: what the first such op reads
    instead. None where no Concat reads a cache or nothing can be said."""
    graph = proto.graph
    inputs = {i.name for i in graph.input}
    caches = [
        n
        for n in graph.node
        if n.op_type == "Concat" and n.input and n.input[0] in inputs and len(declared_dims(proto, n.input[0])) == 4
    ]
    ops = [n for n in graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not caches or not ops:
        return None
    node = ops[0]
    if attribute(node, "is_causal", 0):
        return f"{_named(node)} has is_causal=1, whose causal mask past inputs would align differently"
    producers = {out: n for n in graph.node for out in n.output}
    key = producers.get(node.input[1])
    if key is None or key.op_type == "Concat":
        return f"the key of {_named(node)} is not a Concat(past, new) along the sequence axis read by it alone"
    return (
        f"the key of Attention node '{node.name}' comes from {_named(key)}, not from the cache's Concat "
        f"'{caches[0].name}': what lies between them stays outside the op (a repeat of the key/value heads "
        "folds only as an Unsqueeze, an Expand and a Reshape)"
    )
