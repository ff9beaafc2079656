"""Every intermediate value of one case, one run per side: PyTorch's from the FX program
the dynamo exporter converted (an interpreter keeps each node's output), ONNX Runtime's from
one run of the graph with every value exposed as an output and graph optimizations off, so
that the session runs the nodes the file holds (fusions would hide the values)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from attn_export._deps import require
from attn_export.artifacts.golden import GoldenCase
from attn_export.artifacts.intermediates import Intermediates
from attn_export.errors import RuntimeFailure, UsageError, first_line
from attn_export.exporter.stack import innermost_line
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.memory import format_bytes
from attn_export.runtimes.ort import load_session, run_bounded
from attn_export.runtimes.reference import run_reference_bounded
from attn_export.runtimes.target import Target

__all__ = ["TorchValues", "evaluate", "graph_values", "recorded_values", "torch_values"]


class TorchValues(dict[str, np.ndarray]):
    """PyTorch's value of each FX node that gives a tensor, by node name; which node gives
    each graph output (``outputs``); each node's aten op and source line (``sources``), for
    ONNX nodes that lost the exporter's metadata."""

    outputs: dict[str, str]
    sources: dict[str, tuple[str, str, str]]
    #: Whether a build recorded them: its ``sources`` were read where torch was installed,
    #: which tells torch's frames apart from the module's (``exporter.stack.innermost_line``).
    recorded: bool = False

    @classmethod
    def from_recorded(cls, rec: Intermediates) -> TorchValues:
        """The values ``build --record-intermediates`` kept (``localize --golden``)."""
        values = cls(rec.values)
        values.outputs, values.sources = dict(rec.outputs), dict(rec.sources)
        values.recorded = True
        return values


def recorded_values(program: Any, spec: ModelSpec, case: GoldenCase, budget: int) -> Intermediates:
    """PyTorch's value of every FX node of ``program`` on ``case``, to be written beside the
    graph (``torch_values``; UsageError once they hold more than ``budget`` bytes)."""
    values = torch_values(program, spec, case.inputs, budget)
    return Intermediates(case, dict(values), values.outputs, values.sources)


def torch_values(program: Any, spec: ModelSpec, feeds: Mapping[str, np.ndarray], budget: int) -> TorchValues:
    """Run ``program`` (a torch.export ExportedProgram) on ``feeds`` and keep every tensor
    it computes; refuse once they hold more than ``budget`` bytes."""
    torch = require("torch", "localizing against PyTorch")
    values = TorchValues()
    values.sources = {}
    held = [0]

    class _Keep(torch.fx.Interpreter):  # type: ignore[misc, name-defined]
        def run_node(self, node: Any) -> Any:
            out = super().run_node(node)
            if node.op == "call_function" and isinstance(out, torch.Tensor):
                held[0] += out.numel() * out.element_size()
                if held[0] > budget:
                    raise UsageError(
                        f"{spec.name}: localize keeps every intermediate value, more than the memory budget "
                        f"({format_bytes(budget)}) at these sizes; give smaller --shapes or a larger --max-memory"
                    )
                values[node.name] = out.detach().cpu().numpy().copy()
                line = innermost_line(node.meta.get("stack_trace") or "") or ("", "")
                values.sources[node.name] = (str(node.target), *line)
            return out

    module = program.module()
    args = [torch.from_numpy(np.ascontiguousarray(feeds[t.name])) for t in spec.inputs]
    with torch.no_grad():
        _Keep(module).run(*args)
    returned = next(n for n in module.graph.nodes if n.op == "output").args[0]
    returned = returned if isinstance(returned, tuple | list) else (returned,)
    values.outputs = {t.name: getattr(n, "name", "") for t, n in zip(spec.outputs, returned, strict=False)}
    return values


def evaluate(
    model: onnx.ModelProto,
    names: list[str],
    feeds: Mapping[str, np.ndarray],
    target: Target,
    budget: int,
    timeout_s: float,
) -> list[np.ndarray]:
    """``names`` computed by ``model`` on ``target``: the ONNX reference evaluator, or an
    ONNX Runtime session with graph optimizations off (its arena held to ``budget``), so
    that it runs the nodes the file holds, stopped after ``timeout_s`` seconds (RunTimeout:
    ONNX Runtime's terminate flag, the reference evaluator's Loop). Raises what the runtime
    raises."""
    if target.provider is None:
        return run_reference_bounded(model, names, feeds, timeout_s)
    session = load_session(model.SerializeToString(), target.provider, level="disabled", budget=budget)
    return run_bounded(session, names, feeds, timeout_s)


def graph_values(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], target: Target, budget: int, timeout_s: float
) -> dict[str, np.ndarray]:
    """Every value the graph's nodes compute, from one run on ``target`` with none fused,
    stopped after ``timeout_s`` seconds."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    named = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for name in node.output:
            if name and name not in named:
                exposed.graph.output.append(onnx.ValueInfoProto(name=name))
                named.add(name)
    names = [o.name for o in exposed.graph.output]
    try:
        return dict(zip(names, evaluate(exposed, names, feeds, target, budget, timeout_s), strict=True))
    except Exception as e:  # noqa: BLE001 - ONNX Runtime and the reference evaluator raise their own classes
        raise RuntimeFailure(f"{target.label}: {first_line(e)}") from e
