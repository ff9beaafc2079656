"""A residual ``Add`` and the ``RMSNormalization`` that reads it as one ONNX Runtime op.

onnxruntime-genai's graphs norm each residual sum with ``SkipSimplifiedLayerNormalization``
(com.microsoft): the sum and its norm in one kernel, the sum handed on as the op's fourth
output. ONNX Runtime's optimizer fuses an ``Add`` into ``SimplifiedLayerNormalization``
but not into opset 23's ``RMSNormalization``, which the exporter writes, so a decoder layer
ran two more nodes per residual than genai's.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import onnx
from onnx import helper

from attn_export.exporter.cache_in_op import attribute, declared_dims

__all__ = ["fuse_skip_norms"]

_SKIP_NORM = ("com.microsoft", "SkipSimplifiedLayerNormalization")


def _fusable(proto: onnx.ModelProto, add: onnx.NodeProto, norm: onnx.NodeProto, constants: Set[str]) -> bool:
    """Whether ``norm`` over ``add``'s sum is what the op computes: both addends
    ``[batch, seq, hidden]`` alike, the norm over the last axis in float32 (``stash_type``
    1) by a constant scale (one of ``constants``), no bias."""
    if attribute(norm, "axis", -1) != -1 or attribute(norm, "stash_type", 1) != 1 or len(norm.input) != 2:
        return False
    if norm.input[1] not in constants:
        return False
    left, right = (declared_dims(proto, name) for name in add.input)
    return len(left) == 3 and left == right and isinstance(left[2], int)


def fuse_skip_norms(proto: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> int:
    """Each ``RMSNormalization`` of an ``Add`` in ``nodes`` made one
    ``SkipSimplifiedLayerNormalization`` in the ``Add``'s place, the values keeping their
    names (the sum is the op's fourth output, for the residual's other readers); the count."""
    producers: Mapping[str, onnx.NodeProto] = {out: n for n in nodes for out in n.output}
    constants = {t.name for t in proto.graph.initializer}
    fused: dict[int, onnx.NodeProto] = {}  # the Add's id: the op taking its place
    dropped: set[int] = set()
    for norm in nodes:
        add = producers.get(norm.input[0]) if norm.op_type == "RMSNormalization" and not norm.domain else None
        if add is None or add.op_type != "Add" or add.domain or id(add) in fused:
            continue
        if not _fusable(proto, add, norm, constants):
            continue
        op = helper.make_node(
            _SKIP_NORM[1],
            [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]],
            name=norm.name or norm.output[0],
            domain=_SKIP_NORM[0],
            epsilon=attribute(norm, "epsilon", 1e-5),
        )
        op.metadata_props.extend(norm.metadata_props)
        fused[id(add)] = op
        dropped.add(id(norm))
    nodes[:] = [fused.get(id(n), n) for n in nodes if id(n) not in dropped]
    if fused and all(o.domain != _SKIP_NORM[0] for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(_SKIP_NORM[0], 1))
    return len(fused)
