"""Every intermediate value of one case, one run per side: PyTorch's from the FX program
the dynamo exporter converted (an interpreter keeps each node's output), ONNX Runtime's from
one run of the graph with every value exposed as an output and graph optimizations off, so
that the session runs the nodes the file holds (fusions would hide the values)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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

__all__ = ["TorchValues", "evaluate", "graph_values", "recorded_values", "simulated_values", "torch_values"]


class TorchValues(dict[str, np.ndarray]):
    """PyTorch's value of each FX node that gives a tensor, by node name; which node gives
    each graph output (``outputs``); each node's aten op and source line (``sources``), for
    ONNX nodes that lost the exporter's metadata."""

    outputs: dict[str, str]
    sources: dict[str, tuple[str, str, str]]
    #: Whether a build recorded them: its ``sources`` were read where torch was installed,
    #: which tells torch's frames apart from the module's (``exporter.stack.innermost_line``).
    recorded: bool = False
    #: How many matmuls were rounded as the int4 variant's simulation rounds them (0: none).
    int4_rounded: int = 0
    #: How far each value may move with int4's near ties settled the other way
    #: (``simulated_values``); empty where nothing was rounded.
    ties: dict[str, float]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs, self.sources, self.ties = {}, {}, {}

    @classmethod
    def from_recorded(cls, rec: Intermediates) -> TorchValues:
        """The values ``build --record-intermediates`` kept (``localize --golden``)."""
        values = cls(rec.values)
        values.outputs, values.sources = dict(rec.outputs), dict(rec.sources)
        values.int4_rounded, values.ties = rec.int4_rounded, dict(rec.ties)
        values.recorded = True
        return values


def recorded_values(program: Any, spec: ModelSpec, case: GoldenCase, budget: int, int4: int = 0) -> Intermediates:
    """PyTorch's value of every FX node of ``program`` on ``case``, to be written beside the
    graph (``torch_values``; UsageError once they hold more than ``budget`` bytes); for an
    int4 graph on a CPU whose MatMulNBits compute ``int4`` projections, its simulation's,
    where that rounds as many (``simulated_values``)."""
    values = simulated_values(program, spec, case.inputs, budget, int4) if int4 else None
    values = values or torch_values(program, spec, case.inputs, budget)
    return Intermediates(case, dict(values), values.outputs, values.sources, values.int4_rounded, dict(values.ties))


#: The aten ops the int4 variant turns into a MatMulNBits where their weight is one of the
#: module's own 2-D tensors: the activation's argument, the weight's, and the weight's
#: reduced axis (``runtimes.int8_rounding.rounded`` rounds the same calls).
_INT4_MATMULS = {
    "aten.linear.default": (0, 1, -1),
    "aten.mm.default": (0, 1, -2),
    "aten.matmul.default": (0, 1, -2),
    "aten.addmm.default": (1, 2, -2),
}
#: Ops that give a module's tensor whole (its storage, as the eager simulation's
#: ``is_weight`` reads it), which the export keeps a constant.
_WHOLE_VIEWS = {
    "aten.t.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.numpy_T.default",
    "aten.mT.default",
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
}


def _owned(node: Any) -> bool:
    """Whether an FX argument is one of the module's tensors (a ``get_attr``), or a whole
    view of one (``_WHOLE_VIEWS``): a constant to the export, which the int4 variant quantizes."""
    while getattr(node, "op", None) == "call_function" and str(node.target) in _WHOLE_VIEWS:
        node = node.args[0]
    return getattr(node, "op", None) == "get_attr"


def _int4_operands(node: Any) -> tuple[int, int, int] | None:
    """For an FX node the int4 variant quantizes: its activation's argument, its weight's,
    and the weight's reduced axis; None for any other."""
    operands = _INT4_MATMULS.get(str(node.target)) if node.op == "call_function" else None
    if operands is None or len(node.args) <= operands[1]:
        return None
    act, weight, _ = operands
    unscaled = node.kwargs.get("alpha", 1) == node.kwargs.get("beta", 1) == 1
    return operands if unscaled and _owned(node.args[weight]) and not _owned(node.args[act]) else None


def _run_program(
    program: Any,
    spec: ModelSpec,
    feeds: Mapping[str, np.ndarray],
    keep: Callable[[Any, Any], None],
    tie: float | None,
    activations: bool = True,
) -> tuple[Any, int]:
    """Run ``program`` on ``feeds``, handing each call's tensor to ``keep``; with ``tie`` (not
    None), each matmul the int4 variant quantizes rounded as its simulation rounds it
    (``int4_activation``'s ``tie``; without ``activations``, its weight alone). The module
    run, and how many matmuls were rounded."""
    torch = require("torch", "localizing against PyTorch")
    from attn_export.runtimes.int8_rounding import int4_activation, int4_weight

    count = [0]

    class _Keep(torch.fx.Interpreter):  # type: ignore[misc, name-defined]
        def run_node(self, node: Any) -> Any:
            operands = _int4_operands(node)
            if tie is None or operands is None:
                out = super().run_node(node)
            else:
                args, kwargs = self.fetch_args_kwargs_from_env(node)
                act, weight, axis = operands
                if args[weight].dim() == 2 and args[weight].is_floating_point():
                    codes = int4_activation(args[act], tie) if activations else args[act]
                    args = (*args[:act], codes, *args[act + 1 : weight],
                            int4_weight(args[weight], axis), *args[weight + 1 :])  # fmt: skip
                    count[0] += 1
                out = node.target(*args, **kwargs)
            if node.op == "call_function" and isinstance(out, torch.Tensor):
                keep(node, out)
            return out

    module = program.module()
    args = [torch.from_numpy(np.ascontiguousarray(feeds[t.name])) for t in spec.inputs]
    with torch.no_grad():
        _Keep(module).run(*args)
    return module, count[0]


def torch_values(
    program: Any,
    spec: ModelSpec,
    feeds: Mapping[str, np.ndarray],
    budget: int,
    int4: bool = False,
    activations: bool = True,
) -> TorchValues:
    """Run ``program`` (a torch.export ExportedProgram) on ``feeds`` and keep every tensor
    it computes; refuse once they hold more than ``budget`` bytes. With ``int4``, as the
    int4 variant's simulation computes them (``simulated_values``; without ``activations``,
    as a CPU computes MatMulNBits in float)."""
    values = TorchValues()
    held = [0]

    def keep(node: Any, out: Any) -> None:
        held[0] += out.numel() * out.element_size()
        if held[0] > budget:
            raise UsageError(
                f"{spec.name}: localize keeps every intermediate value, more than the memory budget "
                f"({format_bytes(budget)}) at these sizes; give smaller --shapes or a larger --max-memory"
            )
        values[node.name] = out.detach().cpu().numpy().copy()
        line = innermost_line(node.meta.get("stack_trace") or "") or ("", "")
        values.sources[node.name] = (str(node.target), *line)

    module, values.int4_rounded = _run_program(program, spec, feeds, keep, 0.0 if int4 else None, activations)
    returned = next(n for n in module.graph.nodes if n.op == "output").args[0]
    returned = returned if isinstance(returned, tuple | list) else (returned,)
    values.outputs = {t.name: getattr(n, "name", "") for t, n in zip(spec.outputs, returned, strict=False)}
    return values


def simulated_values(
    program: Any,
    spec: ModelSpec,
    feeds: Mapping[str, np.ndarray],
    budget: int,
    quantized: int,
    activations: bool = True,
) -> TorchValues | None:
    """PyTorch's values as the int4 variant's simulation computes them, which a right int4
    graph on a CPU gives to float32 noise: a region is judged by them as strictly as a float
    graph's (int4's own room hid a block's scales 2 % off), each beside how far its value
    moves where the activations' codes are nudged (``INT4_CASE_TIES``; ``TorchValues.ties``):
    the graph's float rounding may settle a near tie of a code the other way. None where the
    simulation rounds another count of matmuls than the graph's ``quantized`` projections:
    then it does not stand for the graph. Without ``activations`` (a graph computing in
    float), the weights alone are rounded and no code has a tie."""
    from attn_export.runtimes.int8_rounding import INT4_CASE_TIES

    values = torch_values(program, spec, feeds, budget, int4=True, activations=activations)
    if values.int4_rounded != quantized:
        return None

    def widest(node: Any, out: Any) -> None:
        ours = values.get(node.name)
        if ours is None or ours.dtype.kind != "f" or tuple(out.shape) != ours.shape:
            return
        with np.errstate(invalid="ignore"):
            moved = np.abs(out.detach().cpu().numpy() - ours)
        far = float(np.nanmax(np.where(np.isfinite(moved), moved, np.nan), initial=0.0))
        values.ties[node.name] = max(values.ties.get(node.name, 0.0), far)

    for tie in INT4_CASE_TIES if activations else ():
        _run_program(program, spec, feeds, widest, tie)
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
