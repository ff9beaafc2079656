"""gqa-rotary: rotary embeddings inside GroupQueryAttention, and its projections as one MatMul.

A link after ``static-cache`` or ``ort-past``: the opset-23 export keeps a module's rotary
as ``RotaryEmbedding`` nodes on the query and key (their cos and sin computed from the
positions every step), so the projections cannot be packed and each layer runs its rotary,
its layout ops and three MatMuls apart. Here each GroupQueryAttention applies the rotary
itself (``do_rotary`` with cos/sin caches) and reads one packed projection, and each
residual sum is normed in the op that adds it (``skip_norm``): the shape of
onnxruntime-genai's model builder graphs.

The op counts each token's position from its row's length in the mask (its ones, as genai's
graphs read them: a batch padded on the right) and the keys from the mask's width, computed
once for every layer, and keeps no other mask. The caches hold what the graph's nodes
compute for positions 0..N-1 (evaluated on a prompt of N tokens on an empty cache, a mask of
ones), their cos and sin taken by torch as the module takes them. That is the module's own
rotary only where its positions are that count (``model_spec.cache.counted_positions``): no
``position_ids`` input, positions counted from a mask that pads nothing in our loop, no
sliding window shorter than N. The build refuses any other spec.

A partial rotary (a config's ``partial_rotary_factor`` < 1, GPT-NeoX's ``rotary_pct``) turns
the first R channels of each head and passes the rest on. Its cos and sin are R / 2 wide, and
so are the caches: the op turns as many channels as its caches say (twice their width) and
copies the rest, as genai's builder relies on. ONNX Runtime takes caches a multiple of 8 wide
only, so an R not a multiple of 16 is refused, and so is an interleaved rotary, which this
link does not fold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attn_export._deps import require
from attn_export.errors import ExportFailure, SpecError, first_line
from attn_export.exporter.cache_in_op import attribute, declared_dims, fresh_prefixes
from attn_export.exporter.packed_projections import cut_from, pack
from attn_export.exporter.skip_norm import fuse_skip_norms
from attn_export.exporter.variants import VariantGraph, op_counts
from attn_export.exporter.variants.ort_past import _merged_heads, _Nodes, _read, keep_live
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import MASK, cache_of
from attn_export.runtimes.static_cache import CAPACITY_DIM

__all__ = ["make", "refuse_heads"]

_GQA = ("com.microsoft", "GroupQueryAttention")
#: ONNX Runtime's GroupQueryAttention rotates heads, and the channels it turns in each, of a
#: multiple of 16 only (its checks: head_size % 16, the caches' width a multiple of 8).
_MULTIPLE = 16


def refuse_heads(spec: ModelSpec, label: str) -> None:
    """SpecError, before any export, where the spec's cache holds heads GroupQueryAttention
    cannot rotate (a head size not a multiple of ``_MULTIPLE``): the graph would be refused
    only once exported."""
    cache = cache_of(spec)
    key = next((t for t in spec.inputs if cache is not None and t.name == cache.pairs[0][0]), None)
    head = key.shape[-1] if key is not None else None
    if isinstance(head, int) and head % _MULTIPLE:
        raise SpecError(
            f"{label}: gqa-rotary: the cache's heads are {head} wide, and ONNX Runtime's GroupQueryAttention "
            f"applies rotary to heads of a multiple of {_MULTIPLE} only: build it without gqa-rotary "
            "(static-cache alone keeps the module's own rotary)"
        )


@dataclass(frozen=True)
class _Rotary:
    """A ``RotaryEmbedding`` whose output one GroupQueryAttention input only lays out as
    ``[batch, seq, heads * head_dim]``: the heads it reads (``[batch, heads, seq,
    head_dim]``), the cos and sin it reads and whether it pairs channels interleaved."""

    source: str
    cos: str
    sin: str
    interleaved: bool


def _partial(
    proto: onnx.ModelProto,
    node: onnx.NodeProto,
    producers: Mapping[str, onnx.NodeProto],
    constants: Mapping[str, onnx.TensorProto],
) -> tuple[onnx.NodeProto, str] | None:
    """A partial rotary as torch exports it (a config's ``partial_rotary_factor`` < 1), or
    None: a ``Concat`` of a ``RotaryEmbedding`` of each head's first channels and the rest
    of the head, the two cut from the heads by a ``Slice`` each. Returns the rotary and the
    heads."""
    if node.op_type != "Concat" or len(node.input) != 2 or attribute(node, "axis", 0) not in (-1, 3):
        return None
    rotary = producers.get(node.input[0])
    if rotary is None or (rotary.domain, rotary.op_type) != ("", "RotaryEmbedding"):
        return None
    heads = cut_from(proto, [rotary.input[0], node.input[1]], producers, constants)
    return (rotary, heads) if heads is not None else None


def _rotary(
    proto: onnx.ModelProto,
    name: str,
    producers: Mapping[str, onnx.NodeProto],
    constants: Mapping[str, onnx.TensorProto],
) -> _Rotary | None:
    """The rotary behind a GroupQueryAttention input that ``ort-past`` laid out (a Transpose
    to ``[batch, seq, heads, head_dim]`` and a Reshape), whole or partial, or None."""
    merged = producers.get(name)
    moved = producers.get(merged.input[0]) if merged is not None and merged.op_type == "Reshape" else None
    if moved is None or moved.op_type != "Transpose" or attribute(moved, "perm", []) != [0, 2, 1, 3]:
        return None
    node = producers.get(moved.input[0])
    partial = _partial(proto, node, producers, constants) if node is not None else None
    node, heads = partial if partial is not None else (node, None)
    if node is None or (node.domain, node.op_type) != ("", "RotaryEmbedding") or len(node.input) != 3:
        return None
    return _Rotary(heads or node.input[0], node.input[1], node.input[2], bool(attribute(node, "interleaved", 0)))


def _needed(
    proto: onnx.ModelProto, values: Sequence[str], producers: Mapping[str, onnx.NodeProto]
) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes computing ``values`` (in graph order) and the graph inputs they read."""
    inputs = {i.name for i in proto.graph.input}
    seen: set[str] = set()
    nodes: set[int] = set()
    reads: set[str] = set()
    todo = list(values)
    while todo:
        value = todo.pop()
        if value in seen or not value:
            continue
        seen.add(value)
        if value in inputs:
            reads.add(value)
        node = producers.get(value)
        if node is not None and id(node) not in nodes:
            nodes.add(id(node))
            todo.extend(_read(node))
    return [n for n in proto.graph.node if id(n) in nodes], reads


def _feed(proto: onnx.ModelProto, name: str, positions: int) -> np.ndarray:
    """Graph input ``name`` for a prompt of ``positions`` tokens on an empty cache, batch 1:
    a mask of ones, token ids of 0, a filled length of 0, empty pasts (a buffer: zeros)."""
    info = next(i for i in proto.graph.input if i.name == name).type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(info.elem_type)
    dims = declared_dims(proto, name)
    if not dims:
        return np.zeros((), dtype)
    if len(dims) == 2:
        return np.ones((1, positions), dtype) if name == MASK else np.zeros((1, positions), dtype)
    heads, head = dims[1], dims[-1]
    if len(dims) == 4 and isinstance(heads, int) and isinstance(head, int):
        return np.zeros((1, heads, positions if dims[2] == CAPACITY_DIM else 0, head), dtype)
    raise ExportFailure(f"variant gqa-rotary: cannot feed input '{name}' {dims} to compute the rotary's cos and sin")


def _torch_trig() -> list[type]:
    """``Cos`` and ``Sin`` for the reference evaluator, computed by PyTorch: the module takes
    its rotary's cos and sin from torch every step, and ONNX Runtime's differ from torch's by
    a unit in the last place in about one value in five. Measured on a 2-layer Llama in int4,
    caches from ONNX Runtime's ops changed the greedy tokens after one prompt of three
    against genai's graph (whose caches are torch's); torch's gave the same tokens."""
    from onnx.reference.op_run import OpRun

    torch = require("torch", "computing the rotary's cos and sin caches")

    def op(name: str, fn: Any) -> type:
        def _run(self: Any, x: np.ndarray) -> tuple[np.ndarray]:
            return (fn(torch.from_numpy(np.ascontiguousarray(x))).numpy(),)

        return type(name, (OpRun,), {"op_domain": "", "_run": _run})

    return [op("Cos", torch.cos), op("Sin", torch.sin)]


def _caches(
    proto: onnx.ModelProto, values: Sequence[str], positions: int, producers: Mapping[str, onnx.NodeProto]
) -> dict[str, np.ndarray]:
    """Each of ``values`` (a rotary's cos or sin, ``[batch, seq, head_dim / 2]``) at
    positions 0..N-1, as ``[N, head_dim / 2]``, from the nodes that compute them (the
    reference evaluator, ``Cos`` and ``Sin`` by torch: ``_torch_trig``)."""
    from onnx.reference import ReferenceEvaluator

    nodes, reads = _needed(proto, values, producers)
    needed = {n for node in nodes for n in _read(node)}
    graph = helper.make_graph(
        nodes,
        "rotary_caches",
        [i for i in proto.graph.input if i.name in reads],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in values],
        [t for t in proto.graph.initializer if t.name in needed],
    )
    model = helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)
    try:
        found = ReferenceEvaluator(model, new_ops=_torch_trig()).run(
            None, {name: _feed(proto, name, positions) for name in reads}
        )
    except Exception as e:  # noqa: BLE001 - an op the evaluator lacks: the build says which
        raise ExportFailure(
            f"variant gqa-rotary: cannot compute the rotary's cos and sin: {type(e).__name__}: {first_line(e)}"
        ) from e
    caches = {}
    for value, array in zip(values, found, strict=True):
        array = np.asarray(array)
        if array.ndim != 3 or array.shape[:2] != (1, positions):
            raise ExportFailure(
                f"variant gqa-rotary: the rotary's '{value}' is {list(array.shape)} on a prompt of {positions} "
                "tokens, not one row per position"
            )
        caches[value] = np.ascontiguousarray(array[0], dtype=np.float32)
    return caches


def _same(caches: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The one cache the query's and the key's rotary share: GroupQueryAttention takes one."""
    first, *rest = (caches[n] for n in names)
    if any(c.shape != first.shape or not np.array_equal(c, first) for c in rest):
        raise ExportFailure("variant gqa-rotary: the query's and the key's rotary read different cos or sin")
    return first


def _turnable(op: onnx.NodeProto, cache: np.ndarray, head: int) -> np.ndarray:
    """``cache`` where the op turns the channels it says (twice its width: a partial rotary
    turns fewer than the head's, the op passes the rest on); ExportFailure where ONNX
    Runtime would refuse it (a width not a multiple of 8)."""
    turned = 2 * cache.shape[1]
    if turned % _MULTIPLE or turned > head:
        raise ExportFailure(
            f"variant gqa-rotary: '{op.name}' turns {turned} channels of heads of {head} (a partial rotary: "
            f"a config's partial_rotary_factor < 1); ONNX Runtime's GroupQueryAttention turns a multiple of "
            f"{_MULTIPLE} (its cos/sin caches a multiple of 8 wide): build it without gqa-rotary"
        )
    return cache


def _read_lead_axes(nodes: Sequence[onnx.NodeProto], old: Sequence[str], new: str) -> None:
    """Point the ``Shape`` nodes that read the batch or sequence length off the laid-out
    query or key (``ort-past``'s lengths) at ``new``, which has the same two leading axes:
    the rotary and the layout ops before it are left to no reader and dropped."""
    for node in nodes:
        start, end = attribute(node, "start", 0), attribute(node, "end", 4)
        lead = isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= 2
        if node.op_type == "Shape" and node.input[0] in old and lead:
            node.input[0] = new


def _lengths(mask: str, prefix: str) -> tuple[tuple[str, str], list[onnx.NodeProto], list[onnx.TensorProto]]:
    """GroupQueryAttention's ``seqlens_k`` and ``total_sequence_length`` as onnxruntime-genai's
    graphs compute them, once for every layer: each row's ones in the mask less one, and the
    mask's width. The op then reads each row's own length (a batch padded on the right, as
    genai pads it) and writes each new token after it."""
    nodes = _Nodes(f"{prefix}/lengths")
    axis = nodes.const("key_axis", np.array([1], np.int64))
    as_int = nodes.add("Cast", [mask], "mask_i32", to=TensorProto.INT32)  # a bool mask too
    ones = nodes.add("ReduceSum", [as_int, axis], "ones", keepdims=0)
    seqlens = nodes.add("Sub", [ones, nodes.const("one", np.array(1, np.int32))], "seqlens_k")
    width = nodes.add(
        "Gather", [nodes.add("Shape", [mask], "mask_shape"), nodes.const("width_axis", np.array(1))], "width"
    )
    total = nodes.add("Cast", [width], "total", to=TensorProto.INT32)
    return (seqlens, total), nodes.nodes, nodes.constants


def _sole_reader(nodes: Sequence[onnx.NodeProto], value: str, op_type: str) -> onnx.NodeProto | None:
    readers = [n for n in nodes if value in n.input]
    return readers[0] if len(readers) == 1 and readers[0].op_type == op_type else None


def _straight_output(proto: onnx.ModelProto, nodes: list[onnx.NodeProto], op: onnx.NodeProto) -> None:
    """The op's output handed on without what ``ort-past`` put after it for the mask (a
    ``Where`` zeroing rows with no key: each row has its own length now) and, where the
    module merges the heads back at once (a Transpose and a Reshape to ``[batch, seq,
    heads * head_dim]``, after a Reshape to the shape they have, as Phi-3's), straight to
    what reads that last Reshape: the op gives that layout, under that value's name."""
    split = _sole_reader(nodes, op.output[0], "Reshape")
    back = _sole_reader(nodes, split.output[0], "Transpose") if split is not None else None
    seen = _sole_reader(nodes, back.output[0], "Where") if back is not None else None
    if back is None or seen is None or seen.input[1] != back.output[0]:
        return
    back.output[0] = seen.output[0]
    nodes.remove(seen)
    heads, after = declared_dims(proto, back.output[0]), back.output[0]
    same = _sole_reader(nodes, after, "Reshape")
    if same is not None and None not in heads and declared_dims(proto, same.output[0]) == heads:
        after = same.output[0]
    moved = _sole_reader(nodes, after, "Transpose")
    merged = _sole_reader(nodes, moved.output[0], "Reshape") if moved is not None else None
    if moved is None or merged is None or attribute(moved, "perm", []) != [0, 2, 1, 3]:
        return
    if merged.output[0] in {o.name for o in proto.graph.output}:
        return
    dims = declared_dims(proto, merged.output[0])
    sizes = [d for d in (*heads[1:2], *heads[3:4], *dims[2:3]) if isinstance(d, int)]
    if len(heads) == 4 and len(dims) == 3 and len(sizes) == 3 and sizes[0] * sizes[1] == sizes[2]:
        # the op's output takes the merged value's name, its FX node's: localize compares it
        # with PyTorch's there, and the layout ops and shape arithmetic are left to no reader
        nodes.remove(merged)
        op.output[0] = merged.output[0]


def _checked(
    ops: Sequence[onnx.NodeProto], proto: onnx.ModelProto, producers: Mapping[str, onnx.NodeProto]
) -> list[tuple[onnx.NodeProto, _Rotary, _Rotary, int]]:
    """Each op with its query's and its key's rotary and its head size; ExportFailure where
    one has none or one the op cannot apply."""
    if not ops:
        raise ExportFailure(
            "variant gqa-rotary folds rotary into GroupQueryAttention, and the graph has none: "
            "put static-cache or ort-past before it"
        )
    constants = {t.name: t for t in proto.graph.initializer}
    pairs = []
    for op in ops:
        if attribute(op, "do_rotary", 0):
            raise ExportFailure(f"variant gqa-rotary: '{op.name}' applies its rotary already")
        query, key = (_rotary(proto, name, producers, constants) for name in op.input[:2])
        if query is None or key is None:
            rotary = any(n.op_type == "RotaryEmbedding" for n in proto.graph.node)
            raise ExportFailure(
                f"variant gqa-rotary: '{op.name}' reads no RotaryEmbedding on both its query and its key; "
                + (
                    "its rotary is laid out in a way this variant does not read: build it without gqa-rotary"
                    if rotary
                    else "the graph holds no RotaryEmbedding: the module has no rotary, or one the exporter left as "
                    "plain ops (frequencies picked by the length, as longrope's, cannot be baked into "
                    "GroupQueryAttention's cos/sin caches); build it without gqa-rotary"
                )
            )
        head = declared_dims(proto, query.source)[-1]
        if not isinstance(head, int) or head % _MULTIPLE:
            raise ExportFailure(
                f"variant gqa-rotary: head size {head}: ONNX Runtime's GroupQueryAttention applies rotary "
                f"to heads of a multiple of {_MULTIPLE} only"
            )
        if query.interleaved or key.interleaved:
            raise ExportFailure(
                f"variant gqa-rotary: '{op.name}' reads an interleaved rotary (channels turned in pairs of "
                "neighbours), which this variant does not fold: build it without gqa-rotary"
            )
        pairs.append((op, query, key, head))
    return pairs


def make(proto: onnx.ModelProto, provider: str, positions: int) -> VariantGraph:
    """``proto`` with each GroupQueryAttention's rotary folded in, its projections packed and
    its lengths read off the mask, the cos and sin caches holding ``positions`` rows."""
    graph = proto.graph
    producers = {out: n for n in graph.node for out in n.output}
    pairs = _checked([n for n in graph.node if (n.domain, n.op_type) == _GQA], proto, producers)
    cos_sin = sorted({v for _, q, k, _ in pairs for v in (q.cos, q.sin, k.cos, k.sin)})
    caches = _caches(proto, cos_sin, positions, producers)
    prefix = next(fresh_prefixes(proto, "gqa_rotary"))
    tables: dict[bytes, str] = {}  # one cos and one sin cache for every layer that shares them

    def table(array: np.ndarray, label: str) -> str:
        key = label.encode() + array.tobytes()
        if key not in tables:
            tables[key] = f"{prefix}/{label}_cache_{len(tables)}"
            graph.initializer.append(numpy_helper.from_array(array, tables[key]))
        return tables[key]

    masked = any(i.name == MASK for i in graph.input)
    lengths, first, constants = _lengths(MASK, prefix) if masked else (("", ""), [], [])
    graph.initializer.extend(constants)
    packed = 0
    before: list[list[onnx.NodeProto]] = []
    for i, (op, query, key, head) in enumerate(pairs):
        nodes = _Nodes(f"{prefix}/{i}")
        q, k = (
            _merged_heads(proto, r.source, producers) or nodes.to_bsh(r.source, label)
            for r, label in ((query, "q"), (key, "k"))
        )
        inputs = list(op.input) + [""] * (11 - len(op.input))
        inputs[:2] = [q, k]
        made = pack(proto, [q, k, inputs[2]], f"{prefix}/{i}")
        if made is not None:
            (inputs[0], extra), inputs[1], inputs[2] = made, "", ""
            nodes.nodes += extra
            packed += 1
        inputs[7] = table(_turnable(op, _same(caches, [query.cos, key.cos]), head), "cos")
        inputs[8] = table(_same(caches, [query.sin, key.sin]), "sin")
        if masked:  # the mask as genai's graphs read it: each row's length, no bias
            inputs[5], inputs[6], inputs[10] = *lengths, ""
        _read_lead_axes(graph.node, op.input[:2], inputs[0])
        del op.input[:]
        op.input.extend(inputs)
        op.attribute.extend([helper.make_attribute("do_rotary", 1), helper.make_attribute("rotary_interleaved", 0)])
        for new in nodes.nodes:
            new.metadata_props.extend(op.metadata_props)
        graph.initializer.extend(nodes.constants)
        before.append(nodes.nodes)
    kept = [*first, *graph.node]
    for made_nodes in filter(None, before):  # each before the first node that reads it
        made_values = {o for n in made_nodes for o in n.output}
        at = next(i for i, n in enumerate(kept) if made_values & set(n.input))
        kept[at:at] = made_nodes
    if masked:
        for op, *_ in pairs:
            _straight_output(proto, kept, op)
    skip_norms = fuse_skip_norms(proto, kept)
    keep_live(proto, kept)
    info = {
        "rotary_folded": len(pairs), "packed_projections": packed, "skip_norms": skip_norms,
        "ops": dict(op_counts(proto)),
    }  # fmt: skip
    return VariantGraph(proto, info)
