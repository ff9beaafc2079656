"""A module whose forward() updates its own state (a call counter, a cache kept inside the
module) answers each call by its earlier ones, while the ONNX graph keeps no state between
runs: the two agree on the first call at most, and PyTorch cannot be the reference. Two runs
of the module catch a large drift only; the FX program says it outright: an in-place op
writing to a buffer or a plain tensor attribute (or a view of one), the buffers its graph
signature mutates, or an attribute torch saw assigned a new tensor that the graph also reads.
Each is named with the line that updates or reads it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

from attn_export.errors import NondeterministicModule
from attn_export.exporter.stack import innermost_line

__all__ = ["refuse_state_updates"]

#: The warning torch.export gives for tensor attributes assigned in forward().
_ASSIGNED = re.compile(r"The tensor attributes? (.+?) (?:was|were) assigned during export")
#: What the program's input kinds hold, as the message names it.
_STATE = {"BUFFER": "buffer", "CONSTANT_TENSOR": "tensor attribute"}


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


def _assigned(caught: Iterable[warnings.WarningMessage]) -> set[str]:
    """The attributes (``sub.calls``) torch.export warned were assigned a tensor in forward()."""
    found = (_ASSIGNED.search(str(w.message)) for w in caught)
    return {path.removeprefix("self.") for m in found if m for path in m.group(1).split(", ")}


def _ancestors(node: Any) -> set[Any]:
    """Every node ``node``'s value is computed from."""
    seen: set[Any] = set()
    todo = [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return seen


def _overwrite(node: Any, placeholder: Any, order: dict[Any, int]) -> bool:
    """Whether ``node`` writes the whole of ``placeholder``'s state from values the call is
    given, before anything reads its old value: the state a call leaves is then no input to
    the next (transformers' longrope picks its frequencies so, each call from its positions)."""
    if str(node.target) != "aten.copy_.default" or node.args[0] is not placeholder:
        return False
    source = node.args[1]
    if hasattr(source, "op") and (source is placeholder or placeholder in _ancestors(source)):
        return False
    return all(order[user] > order[node] for user in placeholder.users if user is not node)


def _aliased(program: Any, target: str, nodes: dict[str, Any]) -> bool:
    """Whether the program reads another piece of its state that shares ``target``'s memory
    (an attribute holding the buffer, or a view of it): a read the write's own node cannot show."""
    tensors = {**getattr(program, "constants", {}), **program.state_dict}
    own = tensors.get(target)
    if own is None or not hasattr(own, "untyped_storage"):
        return True
    memory = own.untyped_storage().data_ptr()
    shared = {
        name
        for name, tensor in tensors.items()
        if name != target and hasattr(tensor, "untyped_storage") and tensor.untyped_storage().data_ptr() == memory
    }
    specs = program.graph_signature.input_specs
    return any(nodes[s.arg.name].users for s in specs if s.target in shared and s.arg.name in nodes)


def _updates(program: Any, assigned: set[str]) -> tuple[str, str, Any] | None:
    """The first piece of state ``program`` updates so that a call reads what an earlier one
    left: its kind, its name, and the node that writes it (or, for an attribute assigned
    anew, the first that reads its old value). A state written whole from the call's own
    values before any read of it carries nothing between calls, and is no update here."""
    signature = program.graph_signature
    state = {s.arg.name: (_STATE[s.kind.name], s.target) for s in signature.input_specs if s.kind.name in _STATE}
    nodes = {n.name: n for n in program.graph.nodes}
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    for node in program.graph.nodes:
        for arg in _written(node):
            base = _base(arg) if hasattr(arg, "op") else None
            if base is None or base.op != "placeholder" or base.name not in state:
                continue
            if not _overwrite(node, base, order) or _aliased(program, state[base.name][1], nodes):
                return (*state[base.name], node)
    buffers = {s.target: s.arg.name for s in signature.input_specs if s.kind.name == "BUFFER"}
    for output, buffer in getattr(signature, "buffers_to_mutate", {}).items():
        old = nodes.get(buffers.get(buffer, ""))
        if old is None or old.users or _aliased(program, buffer, nodes):  # a functional program reads a
            # buffer's old value only before its write
            return "buffer", buffer, nodes.get(output)
    for name, (kind, target) in state.items():
        if target in assigned:
            return kind, target, next(iter(nodes[name].users), None)
    return None


def refuse_state_updates(program: Any, model: str, caught: Iterable[warnings.WarningMessage] = ()) -> None:
    """``NondeterministicModule`` naming the first buffer or tensor attribute ``program`` (a
    torch.export ExportedProgram) updates in forward(), and the source line that does it;
    ``caught``: the warnings of the export, which name the attributes assigned anew."""
    found = _updates(program, _assigned(caught))
    if found is None:
        return
    kind, name, node = found
    line = innermost_line(node.meta.get("stack_trace") or "") if node is not None else None
    where = f" at {line[0]} `{line[1]}`" if line else ""
    raise NondeterministicModule(
        f"{model}: forward() updates the module's {kind} '{name}'{where}, so each call depends on the calls "
        "before it, and the ONNX graph keeps no state between runs; pass that state as an input and return "
        "its new value as an output (as a KV cache is)"
    )
