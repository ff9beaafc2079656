"""Which execution provider ran each node of a graph, read from ONNX Runtime's per-node profile.

A session asked for CUDA still runs every node CUDA has no kernel for on the CPU, silently:
numerics agree, and the latency is not the device's. ONNX Runtime's profile
(``SessionOptions.enable_profiling``) records, for every node it ran, an event of category
``Node`` named ``<node>_kernel_time`` whose ``args`` hold ``op_name``, ``provider`` and the
types and shapes of its inputs and outputs (``input_type_shape``, ``output_type_shape``).

ONNX Runtime also puts shape and index arithmetic on the CPU on purpose when another
provider is asked for (``GetCpuPreferredNodes``: small integer tensors computed from
``Shape``), so nodes off the asked provider fall in two groups: *fallbacks*, which handle
float (or quantized) data, and *shape ops*, whose every input and output is an int32,
int64 or bool tensor, or holds a single element. Only fallbacks can fail a case
(``compare.placement``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_export.artifacts.files import read_regular
from attn_export.artifacts.json_fields import json_field, json_record
from attn_export.errors import AttnExportError, RuntimeFailure

__all__ = ["OpCount", "Placement", "describe_counts", "placement_from_profile", "read_profile"]

#: Element types of shape and index arithmetic, as the profile names them.
_INDEX_TYPES = frozenset({"int32", "int64", "bool"})
#: A profile of one run is small; a larger one is not what we asked ONNX Runtime for.
_PROFILE_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class OpCount:
    """How many nodes of one op type ran on one provider."""

    op_type: str
    provider: str
    count: int

    def describe(self) -> str:
        return f"{self.op_type} x{self.count}"

    def to_dict(self) -> dict[str, Any]:
        return {"op_type": self.op_type, "provider": self.provider, "count": self.count}


@dataclass
class Placement:
    """Where ONNX Runtime ran one graph's nodes, asked for ``provider`` (its ONNX Runtime
    name): nodes per provider, and the nodes elsewhere by op type. ``error`` says why the
    placement could not be read (the counts are then empty)."""

    provider: str
    by_provider: dict[str, int] = field(default_factory=dict)
    #: Nodes on another provider that handle float or quantized data.
    fallbacks: list[OpCount] = field(default_factory=list)
    #: Shape and index arithmetic on another provider: ONNX Runtime's choice, never a failure.
    shape_ops: list[OpCount] = field(default_factory=list)
    error: str | None = None

    @property
    def nodes(self) -> int:
        return sum(self.by_provider.values())

    def summary(self) -> str:
        """One line for reports: ``all 57 nodes on CPUExecutionProvider``, or the nodes
        elsewhere by op type and count."""
        if self.error:
            return f"not read: {self.error}"
        if not self.fallbacks and not self.shape_ops:
            return f"all {self.nodes} nodes on {self.provider}"
        parts = [f"fallbacks: {describe_counts(self.fallbacks)}"] if self.fallbacks else []
        parts += [f"shape ops: {describe_counts(self.shape_ops)}"] if self.shape_ops else []
        return f"{self.nodes} nodes, asked for {self.provider}; " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "nodes": self.nodes,
            "by_provider": dict(self.by_provider),
            "fallbacks": [c.to_dict() for c in self.fallbacks],
            "shape_ops": [c.to_dict() for c in self.shape_ops],
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "placement") -> Placement:
        """The placement ``to_dict`` wrote; ArtifactError naming the first field not of its
        type (a report is read from anywhere)."""
        counts = {
            k: [json_record(OpCount, c, f"{where}.{k}[{i}]") for i, c in enumerate(json_field(d, k, list, where))]
            for k in ("fallbacks", "shape_ops")
        }
        return cls(
            json_field(d, "provider", str, where),
            dict(json_field(d, "by_provider", dict[str, int], where)),
            counts["fallbacks"],
            counts["shape_ops"],
            json_field(d, "error", str | None, where, None),
        )


def describe_counts(counts: Sequence[OpCount]) -> str:
    """``Attention x1, Softmax x2 on CPUExecutionProvider``, one clause per provider."""
    providers = dict.fromkeys(c.provider for c in counts)
    return "; ".join(", ".join(c.describe() for c in counts if c.provider == p) + f" on {p}" for p in providers)


def _tensors(args: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(element type, element count) of each input and output a node event records."""
    out = []
    for key in ("input_type_shape", "output_type_shape"):
        for entry in args.get(key) or []:
            for dtype, shape in dict(entry).items():
                out.append((str(dtype), math.prod(int(d) for d in shape)))
    return out


def _shape_op(args: Mapping[str, Any]) -> bool:
    """Whether a node only does shape and index arithmetic: every tensor an index type, or
    a single element (a scale computed from a shape)."""
    return all(dtype in _INDEX_TYPES or count <= 1 for dtype, count in _tensors(args))


def _counts(found: Iterable[tuple[str, str]]) -> list[OpCount]:
    return [OpCount(op, provider, n) for (provider, op), n in sorted(Counter(found).items())]


def placement_from_profile(events: Sequence[Mapping[str, Any]], provider: str) -> Placement:
    """The placement recorded in a profile's events for a session asked for ``provider``.
    Each node counts once, however often it ran (a node inside a loop runs many times)."""
    nodes: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    for event in events:
        name, args = event.get("name"), event.get("args")
        if event.get("cat") != "Node" or not isinstance(name, str) or not name.endswith("_kernel_time"):
            continue
        if not isinstance(args, Mapping) or "provider" not in args or "op_name" not in args:
            continue
        nodes.setdefault((name, str(args["op_name"]), str(args.get("node_index", ""))), args)
    if not nodes:
        return Placement(provider, error="the profile recorded no node")
    by_provider = Counter(str(a["provider"]) for a in nodes.values())
    elsewhere = [(a, _shape_op(a)) for a in nodes.values() if a["provider"] != provider]
    return Placement(
        provider,
        dict(sorted(by_provider.items())),
        _counts((str(a["provider"]), str(a["op_name"])) for a, shape in elsewhere if not shape),
        _counts((str(a["provider"]), str(a["op_name"])) for a, shape in elsewhere if shape),
    )


def read_profile(path: Path) -> list[dict[str, Any]]:
    """The events of a profile ONNX Runtime wrote (a JSON list), read with a bounded size."""
    try:
        events = json.loads(read_regular(path, limit=_PROFILE_LIMIT))
    except (AttnExportError, ValueError) as e:
        raise RuntimeFailure(f"cannot read ONNX Runtime's profile: {e}") from e
    if not isinstance(events, list):
        raise RuntimeFailure(f"{path}: ONNX Runtime's profile is not a list of events")
    return [e for e in events if isinstance(e, dict)]
