"""One MatMul for a query, key and value projected from one input.

A decode step multiplies one token by three weights: three small MatMuls, each with its
bias Add and its own hand-off to the thread pool. ONNX Runtime's ``GroupQueryAttention``
also reads the three as one packed ``[batch, seq, (heads + 2 * kv_heads) * head_dim]``
tensor, so one MatMul over the weights side by side does the same work in two nodes, not
six: the same numbers, a step at past 512 about a tenth faster at 2 threads and within
the noise at 1 (``docs/performance.md``).
The packed MatMul records each weight's columns (``PACKED_COLUMNS``) for the int8 link,
which rounds each part with a scale of its own, as it rounds weights apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["PACKED_COLUMNS", "pack", "packed_weights"]

#: Metadata of a packed MatMul: the column count of each weight it holds, comma-separated.
PACKED_COLUMNS = "attn_export.packed_columns"


@dataclass(frozen=True)
class _Projection:
    input: str
    weight: onnx.TensorProto
    bias: onnx.TensorProto | None


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
    bias = None
    if node is not None and (node.domain, node.op_type) == ("", "Add"):
        found = [
            (producers[a], constants[b])
            for a, b in (node.input, reversed(node.input))
            if a in producers and producers[a].op_type == "MatMul" and readers[a] == 1 and b in constants
        ]
        if not found:
            return None
        node, bias = found[0]
    if node is None or (node.domain, node.op_type) != ("", "MatMul") or node.input[1] not in constants:
        return None
    weight = constants[node.input[1]]
    if len(weight.dims) != 2 or (bias is not None and list(bias.dims) != [weight.dims[1]]):
        return None
    if bias is not None and bias.data_type != weight.data_type:
        return None
    return _Projection(node.input[0], weight, bias)


def pack(proto: onnx.ModelProto, values: Sequence[str], prefix: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """The name of one packed projection standing for ``values`` (each ``x @ W (+ b)`` on the
    same ``x``, each read by one node alone) and the nodes computing it; their weights are
    added to ``proto``'s initializers. None where they are not such projections: the
    caller keeps them as they are."""
    graph = proto.graph
    producers = {out: n for n in graph.node for out in n.output}
    constants = {t.name: t for t in graph.initializer}
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
    matmul.metadata_props.add(key=PACKED_COLUMNS, value=",".join(map(str, columns)))
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


def packed_weights(proto: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Each packed MatMul's weight and the column counts of the weights it holds."""
    found = {}
    for node in proto.graph.node:
        columns = next((p.value for p in node.metadata_props if p.key == PACKED_COLUMNS), None)
        if node.op_type == "MatMul" and columns:
            found[node.input[1]] = tuple(int(c) for c in columns.split(","))
    return found
