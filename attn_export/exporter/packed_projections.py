"""One MatMul for a query, key and value projected from one input.

A decode step multiplies one token by three weights: three small MatMuls, each with its
bias Add and its own hand-off to the thread pool. ONNX Runtime's ``GroupQueryAttention``
also reads the three as one packed ``[batch, seq, (heads + 2 * kv_heads) * head_dim]``
tensor, so one MatMul over the weights side by side does the same work in two nodes, not
six: the same numbers, a step at past 512 about a tenth faster at 2 threads and within
the noise at 1 (``docs/performance.md``). The packed MatMul records the projections it
holds (``PACKED``): their columns for the int8 link, which rounds each part with a scale
of its own, as it rounds weights apart, and the nodes they were for localization, which
takes them apart again (``unpacked``). A rewrite that replaces the MatMul (int8's
``MatMulInteger`` and its scales, int4's ``MatMulNBits``) hands the record on to the node
that now gives the packed value (``keep_records``); localization then cuts that value into the projections with a
``Slice`` each, so a fault in the key's columns is still named at the key's projection.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attn_export.artifacts.json_text import json_text
from attn_export.errors import ArtifactError
from attn_export.exporter.cache_in_op import declared_dims

__all__ = [
    "PACKED",
    "cut_from",
    "keep_records",
    "pack",
    "packed_records",
    "packed_weights",
    "projections",
    "unpacked",
]

#: Metadata of a packed MatMul: JSON, one entry per projection it holds, in column order:
#: its column count and the MatMul (and bias Add, or null) it was, by name, output and
#: metadata, for ``unpacked``.
PACKED = "attn_export.packed_projections"


@dataclass(frozen=True)
class _Projection:
    input: str
    weight: onnx.TensorProto
    bias: onnx.TensorProto | None
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None


def _projection(
    value: str,
    producers: Mapping[str, onnx.NodeProto],
    constants: Mapping[str, onnx.TensorProto],
    readers: Counter[str],
) -> _Projection | None:
    """``value`` as ``x @ W (+ b)``, ``W`` a 2-D and ``b`` a 1-D constant and each step read
    by the next alone, or None."""
    if readers[value] != 1:
        return None
    node = producers.get(value)
    add, bias = None, None
    if node is not None and (node.domain, node.op_type) == ("", "Add"):
        found = [
            (producers[a], constants[b])
            for a, b in (node.input, reversed(node.input))
            if a in producers and producers[a].op_type == "MatMul" and readers[a] == 1 and b in constants
        ]
        if not found:
            return None
        add, (node, bias) = node, found[0]
    if node is None or (node.domain, node.op_type) != ("", "MatMul") or node.input[1] not in constants:
        return None
    weight = constants[node.input[1]]
    if len(weight.dims) != 2 or (bias is not None and list(bias.dims) != [weight.dims[1]]):
        return None
    if bias is not None and bias.data_type != weight.data_type:
        return None
    return _Projection(node.input[0], weight, bias, node, add)


def _described(node: onnx.NodeProto | None) -> dict[str, Any] | None:
    if node is None:
        return None
    return {"name": node.name, "output": node.output[0], "metadata": {p.key: p.value for p in node.metadata_props}}


def _slice_bounds(cut: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> list[int] | None:
    """A ``Slice``'s start, end, axis and step, each one constant number, or None."""
    found = [constants.get(name) for name in cut.input[1:]]
    numbers = [int(numpy_helper.to_array(t).item()) for t in found if t is not None and list(t.dims) == [1]]
    return [*numbers, 1][:4] if len(numbers) == len(found) and len(numbers) in (3, 4) else None


def cut_from(
    proto: onnx.ModelProto,
    values: Sequence[str],
    producers: Mapping[str, onnx.NodeProto],
    constants: Mapping[str, onnx.TensorProto],
) -> str | None:
    """The value whose last axis ``values`` cut end to end, in order, a ``Slice`` each, or
    None: a projection the module packs itself (Phi-3's ``qkv_proj``), read as it is, or
    heads a partial rotary cuts into the channels it turns and the rest."""
    cuts = [n for v in values if (n := producers.get(v)) is not None and n.op_type == "Slice"]
    if len(cuts) != len(values) or len({c.input[0] for c in cuts}) != 1:
        return None
    dims = declared_dims(proto, cuts[0].input[0])
    width = dims[-1] if dims else None
    end = 0
    for cut in cuts:
        bounds = _slice_bounds(cut, constants)
        if not isinstance(width, int) or bounds is None:
            return None
        start, stop, axis, step = bounds
        if axis not in (-1, len(dims) - 1) or step != 1 or start != end or min(stop, width) <= start:
            return None
        end = min(stop, width)
    return cuts[0].input[0] if end == width else None


def pack(proto: onnx.ModelProto, values: Sequence[str], prefix: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """The name of one packed projection standing for ``values`` (each ``x @ W (+ b)`` on the
    same ``x``, each read by one node alone) and the nodes computing it; their weights are
    added to ``proto``'s initializers. Where ``values`` are cut from one projection already
    (``cut_from``), that one and no nodes. None where they are neither: the caller keeps
    them as they are."""
    graph = proto.graph
    producers = {out: n for n in graph.node for out in n.output}
    constants = {t.name: t for t in graph.initializer}
    whole = cut_from(proto, values, producers, constants)
    if whole is not None:
        return whole, []
    readers = Counter(name for n in graph.node for name in n.input) + Counter(o.name for o in graph.output)
    found = [_projection(v, producers, constants, readers) for v in values]
    projections = [p for p in found if p is not None]
    if len(projections) != len(values) or len({p.input for p in projections}) != 1:
        return None
    if len({p.weight.data_type for p in projections}) != 1:
        return None
    weights = [numpy_helper.to_array(p.weight) for p in projections]
    columns = [w.shape[1] for w in weights]
    packed = numpy_helper.from_array(np.concatenate(weights, axis=1), f"{prefix}/qkv_weight")
    graph.initializer.append(packed)
    out = f"{prefix}/qkv"
    matmul = helper.make_node("MatMul", [projections[0].input, packed.name], [f"{out}_matmul"], name=f"{out}_matmul")
    parts = [
        {"columns": n, "matmul": _described(p.matmul), "add": _described(p.add)}
        for p, n in zip(projections, columns, strict=True)
    ]
    matmul.metadata_props.add(key=PACKED, value=json_text(parts, indent=None, end=""))
    nodes = [matmul]
    if any(p.bias is not None for p in projections):
        biases = [
            numpy_helper.to_array(p.bias) if p.bias is not None else np.zeros(n, w.dtype)
            for p, n, w in zip(projections, columns, weights, strict=True)
        ]
        graph.initializer.append(numpy_helper.from_array(np.concatenate(biases), f"{prefix}/qkv_bias"))
        nodes.append(helper.make_node("Add", [matmul.output[0], f"{prefix}/qkv_bias"], [out], name=out))
    else:
        matmul.output[0] = out
    return out, nodes


def _described_ok(node: object) -> bool:
    return (
        isinstance(node, dict)
        and isinstance(node.get("name"), str)
        and isinstance(node.get("output"), str)
        and bool(node["output"])
        and isinstance(node.get("metadata"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in node["metadata"].items())
    )


def _parts(node: onnx.NodeProto) -> list[dict[str, Any]]:
    """The projections a packed MatMul records, or the node a rewrite handed its record on
    to (``keep_records``); [] for any other node. A graph is data: a record that does not
    say that is an ArtifactError naming the node."""
    text = next((p.value for p in node.metadata_props if p.key == PACKED), None)
    if not text:
        return []
    try:
        parts = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"node '{node.name}': its {PACKED} metadata is not JSON: {e}") from e
    fine = isinstance(parts, list) and len(parts) > 0
    for part in parts if fine else []:
        columns = part.get("columns") if isinstance(part, dict) else None
        fine = fine and isinstance(columns, int) and not isinstance(columns, bool) and columns > 0
        fine = fine and _described_ok(part.get("matmul")) and (part.get("add") is None or _described_ok(part["add"]))
    if not fine:
        raise ArtifactError(
            f"node '{node.name}': its {PACKED} metadata is malformed (a list of projections, each with "
            "positive 'columns', its 'matmul' and its 'add' or null)"
        )
    return list(parts)


def projections(node: onnx.NodeProto) -> int:
    """How many of the module's projections ``node`` computes: those its record packs, else one."""
    return len(_parts(node)) or 1


def packed_weights(proto: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Each packed MatMul's weight and the column counts of the weights it holds."""
    matmuls = (n for n in proto.graph.node if n.op_type == "MatMul")
    return {n.input[1]: tuple(int(p["columns"]) for p in parts) for n in matmuls if (parts := _parts(n))}


def packed_records(proto: onnx.ModelProto) -> dict[str, str]:
    """Each packed MatMul's record, by the value it gives: what ``keep_records`` hands on,
    read before a rewrite that changes the graph in place (int4's quantizer does)."""
    return {n.output[0]: p.value for n in proto.graph.node for p in n.metadata_props if p.key == PACKED}


def keep_records(records: Mapping[str, str], after: onnx.ModelProto) -> None:
    """Hand each record (``packed_records`` of the graph before a rewrite) on to the node of
    ``after`` that gives the same value, where the rewrite replaced the packed MatMul and
    dropped its metadata (int8's ``quantize_dynamic`` keeps the value's name and makes it
    with a Mul of the scales, int4's quantizer with a ``MatMulNBits``). A value ``after`` no
    longer has keeps no record: localization judges the packed nodes as one region, as
    before packing."""
    for node in after.graph.node:
        value = node.output[0] if node.output else ""
        if value in records and not any(p.key == PACKED for p in node.metadata_props):
            node.metadata_props.add(key=PACKED, value=records[value])


def _node(op: str, inputs: list[str], described: Mapping[str, Any]) -> onnx.NodeProto:
    node = helper.make_node(op, inputs, [str(described["output"])], name=str(described["name"]))
    for key, value in dict(described["metadata"]).items():
        node.metadata_props.add(key=str(key), value=str(value))
    return node


def _apart(
    node: onnx.NodeProto,
    parts: list[dict[str, Any]],
    add: onnx.NodeProto | None,
    constants: Mapping[str, onnx.TensorProto],
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], bool]:
    """The nodes and weights standing for one packed MatMul and its bias ``add``, and
    whether they stand for ``add`` too. Every number of the packed graph is kept: a part
    recorded without a bias still adds its share of the packed bias (zeros, unless the
    graph was changed), in an Add of its own. A node other than the MatMul (the one a
    rewrite handed the record on to) stays, and each projection is a ``Slice`` of its value."""
    width = sum(int(p["columns"]) for p in parts)
    if node.op_type != "MatMul":
        return _sliced(node, parts, add, constants, width)
    if node.input[1] not in constants:
        raise ArtifactError(f"node '{node.name}': a packed projection whose weight is not a constant")
    weight = numpy_helper.to_array(constants[node.input[1]])
    if weight.ndim != 2 or weight.shape[1] != width:
        shape = list(weight.shape)
        raise ArtifactError(f"node '{node.name}': its {PACKED} metadata holds {width} columns, its weight is {shape}")
    bias_name, bias = _bias(add, constants, width)
    starts = _starts(parts)
    nodes, weights = [], []
    for k, part in enumerate(parts):
        cut = slice(int(starts[k]), int(starts[k + 1]))
        weights.append(numpy_helper.from_array(np.ascontiguousarray(weight[:, cut]), f"{node.input[1]}/part{k}"))
        nodes.append(_node("MatMul", [node.input[0], weights[-1].name], part["matmul"]))
    return _joined(node, parts, add, nodes, weights, bias_name, bias)


def _starts(parts: list[dict[str, Any]]) -> np.ndarray:
    """Where each projection's columns start in the packed value, and the width at the end."""
    return np.cumsum([0, *(int(p["columns"]) for p in parts)])


def _bias(add: onnx.NodeProto | None, constants: Mapping[str, onnx.TensorProto], width: int) -> tuple[str, Any]:
    """The packed bias ``add`` adds (its name and value), or ('', None) where it adds no
    bias of the packed projection's width: that Add stays, reading the parts side by side."""
    name = next((i for i in add.input if i in constants), "") if add is not None else ""
    bias = numpy_helper.to_array(constants[name]) if name else None
    return (name, bias) if bias is not None and bias.shape == (width,) else ("", None)


def _sliced(
    node: onnx.NodeProto,
    parts: list[dict[str, Any]],
    add: onnx.NodeProto | None,
    constants: Mapping[str, onnx.TensorProto],
    width: int,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], bool]:
    """``_apart`` for a node a rewrite handed the record on to: the node itself, then each
    projection a ``Slice`` of its last axis standing for that projection's MatMul (its name,
    output and metadata), so the region cut falls between the packed value and each
    projection. The width the record holds is checked against the bias only: the node's
    own shape is known when it runs."""
    bias_name, bias = _bias(add, constants, width)
    starts = _starts(parts)
    whole = onnx.NodeProto()
    whole.CopyFrom(node)
    whole.output[0] = f"{node.output[0]}/packed"  # the Concat gives the packed value its name back
    kept = [p for p in whole.metadata_props if p.key != PACKED]
    del whole.metadata_props[:]
    whole.metadata_props.extend(kept)
    nodes, weights = [], []
    for k, part in enumerate(parts):
        bounds = [f"{node.output[0]}/part{k}/{what}" for what in ("starts", "ends", "axes")]
        for name, value in zip(bounds, (starts[k], starts[k + 1], -1), strict=True):
            weights.append(numpy_helper.from_array(np.array([value], np.int64), name))
        nodes.append(_node("Slice", [whole.output[0], *bounds], part["matmul"]))
    return _joined(node, parts, add, nodes, weights, bias_name, bias, first=[whole])


def _joined(
    node: onnx.NodeProto,
    parts: list[dict[str, Any]],
    add: onnx.NodeProto | None,
    nodes: list[onnx.NodeProto],
    weights: list[onnx.TensorProto],
    bias_name: str,
    bias: Any,
    first: Sequence[onnx.NodeProto] = (),
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], bool]:
    """Each projection's node (in ``nodes``, one per part), its share of the packed bias
    where there is one, and their Concat giving the packed value."""
    starts = _starts(parts)
    out, values = list(first), []
    for k, (part, made) in enumerate(zip(parts, nodes, strict=True)):
        out.append(made)
        value = made.output[0]
        if bias is not None:
            cut = slice(int(starts[k]), int(starts[k + 1]))
            weights.append(numpy_helper.from_array(np.ascontiguousarray(bias[cut]), f"{bias_name}/part{k}"))
            unnamed = {"name": f"{value}/bias", "output": f"{value}/bias", "metadata": {}}
            out.append(_node("Add", [value, weights[-1].name], part["add"] or unnamed))
            value = out[-1].output[0]
        values.append(value)
    packed = add.output[0] if add is not None and bias is not None else node.output[0]
    out.append(helper.make_node("Concat", values, [packed], name=f"{packed}/unpacked", axis=-1))
    return out, weights, bias is not None


def _check_names(graph: onnx.GraphProto, records: Mapping[int, list[dict[str, Any]]]) -> None:
    """The names the packed records give back must be new to the graph and to each other:
    an ArtifactError naming the first that is not."""
    values = {i.name for i in (*graph.input, *graph.initializer, *graph.output)}
    values |= {o for n in graph.node for o in n.output}
    names = {n.name for n in graph.node if n.name}
    for i, node in enumerate(graph.node):
        for made in (m for part in records.get(i, []) for m in (part["matmul"], part["add"]) if m is not None):
            if made["output"] in values or (made["name"] and made["name"] in names):
                raise ArtifactError(
                    f"node '{node.name}': its {PACKED} metadata gives back '{made['output']}' "
                    f"(node '{made['name']}'), a name the graph already has"
                )
            values.add(made["output"])
            names.add(made["name"])


def unpacked(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with each packed projection back as the projections it was made from, each
    with its own MatMul (and bias Add), name and export metadata, their results side by side
    (a ``Concat``) where the packed one was read: the same numbers, for localization, which
    judges each projection against PyTorch's value of it. ``proto`` itself is not changed."""
    records = {i: parts for i, n in enumerate(proto.graph.node) if (parts := _parts(n))}
    if not records:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    constants = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    _check_names(graph, records)
    nodes: list[onnx.NodeProto] = []
    dropped: list[onnx.NodeProto] = []  # the packed bias Adds, whose value the Concat now makes
    for i, node in enumerate(graph.node):
        if any(node is d for d in dropped):
            continue
        if i not in records:
            nodes.append(node)
            continue
        read = readers.get(node.output[0], [])  # its bias Add, where that alone reads it
        add = read[0] if len(read) == 1 and read[0].op_type == "Add" else None
        made, weights, with_bias = _apart(node, records[i], add, constants)
        nodes += made
        graph.initializer.extend(weights)
        if with_bias and add is not None:
            dropped.append(add)
    graph.ClearField("node")
    graph.node.extend(nodes)
    return out
