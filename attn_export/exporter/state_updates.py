"""A module whose forward() updates its own buffers (a call counter, a cache kept inside the
module) answers each call by its earlier ones, while the ONNX graph keeps no state between
runs: the two agree on the first call at most, and PyTorch cannot be the reference. Two runs
of the module catch a large drift only; the FX program says it outright: an in-place op
writing to a buffer (or a view of one), or, in a functional program, the buffers its graph
signature mutates. Each is named with the line that updates it.
"""

from __future__ import annotations

from typing import Any

from attn_export.errors import NondeterministicModule
from attn_export.exporter.stack import innermost_line

__all__ = ["refuse_state_updates"]


def _schema(node: Any) -> Any:
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _written(node: Any) -> list[Any]:
    """The arguments an in-place op of ``node`` writes to (none for a functional op)."""
    schema = _schema(node)
    if schema is None:
        return []
    writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    return [node.args[i] for i in writes if i < len(node.args)]


def _base(node: Any) -> Any:
    """The tensor ``node`` is a view of (through slices, selects, views), or itself."""
    while True:
        schema = _schema(node)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or not node.args:
            return node
        node = node.args[0]


def _updates(program: Any) -> tuple[str, Any] | None:
    """The first buffer ``program`` updates, and the node computing its new value."""
    signature = program.graph_signature
    buffers = {s.arg.name: s.target for s in signature.input_specs if s.kind.name == "BUFFER"}
    for node in program.graph.nodes:
        for arg in _written(node):
            base = _base(arg) if hasattr(arg, "op") else None
            if base is not None and base.op == "placeholder" and base.name in buffers:
                return buffers[base.name], node
    nodes = {n.name: n for n in program.graph.nodes}
    for output, buffer in getattr(signature, "buffers_to_mutate", {}).items():
        return buffer, nodes.get(output)
    return None


def refuse_state_updates(program: Any, model: str) -> None:
    """``NondeterministicModule`` naming the first buffer ``program`` (a torch.export
    ExportedProgram) updates in forward(), and the source line that updates it."""
    found = _updates(program)
    if found is None:
        return
    buffer, node = found
    line = innermost_line(node.meta.get("stack_trace") or "") if node is not None else None
    where = f" at {line[0]} `{line[1]}`" if line else ""
    raise NondeterministicModule(
        f"{model}: forward() updates the module's buffer '{buffer}'{where}, so each call depends on the calls "
        "before it, and the ONNX graph keeps no state between runs; pass that state as an input and return "
        "its new value as an output (as a KV cache is)"
    )
