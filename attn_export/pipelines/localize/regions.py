"""The graph cut into regions, one per FX node: the ONNX nodes the dynamo exporter made from
it (its ``pkg.torch.onnx.fx_node`` metadata), the values they read from outside, and the
value that holds the FX node's result. Each region can run alone on given inputs, which is
how it is teacher-forced: fed PyTorch's values, its error is its own, not inherited."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from attn_export.errors import first_line
from attn_export.exporter.stack import innermost_line
from attn_export.runtimes.ort import load_session

__all__ = ["Region", "graph_regions", "region_model", "run_region"]

_FX_NAME = re.compile(r"%(\S+) :")
_TARGET = re.compile(r"target=(?:torch\.ops\.)?([\w.]+)")


@dataclass(frozen=True)
class Region:
    """The ONNX nodes made from one FX node (a node without export metadata is a region of
    its own with no ``fx_node``), with what they read and where they came from."""

    fx_node: str
    nodes: tuple[str, ...]
    #: The nodes' places in the graph (names may be empty or repeated in a file from elsewhere).
    indices: tuple[int, ...]
    ops: tuple[str, ...]
    #: Values read from outside the region (graph inputs and other regions' values).
    inputs: tuple[str, ...]
    #: The value holding the FX node's result ('' when none of the region's values does).
    value: str
    #: The aten op (``aten.linear.default``), the module path and the source line.
    target: str
    module_path: str
    source: str
    code: str


def _metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _module_path(scopes: str) -> str:
    """``module.q_proj`` from name scopes ``['', 'module', 'module.q_proj', 'linear']``."""
    try:
        names = ast.literal_eval(scopes) if scopes else []
    except (ValueError, SyntaxError):
        return ""
    return str(names[-2]) if isinstance(names, list) and len(names) >= 2 else ""


def graph_regions(model: onnx.ModelProto, output_nodes: Mapping[str, str], known: Collection[str] = ()) -> list[Region]:
    """The graph's regions in the order their first node runs; ``output_nodes`` maps each
    graph output to the FX node it holds (the exporter renames those values). A node
    without the exporter's metadata is a region of its own, compared where one of its
    values is named for an FX node in ``known`` (a rewrite that kept the name)."""
    weights = {i.name for i in model.graph.initializer}
    groups: dict[str, list[tuple[int, onnx.NodeProto]]] = {}
    for i, node in enumerate(model.graph.node):
        found = _FX_NAME.match(_metadata(node).get("pkg.torch.onnx.fx_node", ""))
        groups.setdefault(found.group(1) if found else f"<{i}>", []).append((i, node))
    by_fx = {fx: out for out, fx in output_nodes.items()}
    regions = []
    for key, members in groups.items():
        nodes = [n for _, n in members]
        made = {o for n in nodes for o in n.output if o}
        read = dict.fromkeys(i for n in nodes for i in n.input if i and i not in made and i not in weights)
        fx = next((o for o in made if o in known), "") if key.startswith("<") else key
        value = fx if fx in made else by_fx.get(fx, "") if by_fx.get(fx, "") in made else ""
        meta = _metadata(nodes[0])
        target = _TARGET.search(meta.get("pkg.torch.onnx.fx_node", ""))
        line = innermost_line(meta.get("pkg.torch.onnx.stack_trace", ""))
        regions.append(
            Region(
                fx_node=fx,
                nodes=tuple(n.name or f"#{i} ({n.op_type})" for i, n in members),
                indices=tuple(i for i, _ in members),
                ops=tuple(n.op_type for n in nodes),
                inputs=tuple(read),
                value=value,
                target=target.group(1) if target else "",
                module_path=_module_path(meta.get("pkg.torch.onnx.name_scopes", "")),
                source=line[0] if line else "",
                code=line[1] if line else "",
            )
        )
    return regions


def region_model(model: onnx.ModelProto, region: Region, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The region's nodes as a model of their own: ``feeds`` (one per region input) give
    the inputs' types and shapes, every value the nodes compute is an output."""
    nodes = [model.graph.node[i] for i in region.indices]
    used = {i for n in nodes for i in n.input}
    made = list(dict.fromkeys(o for n in nodes for o in n.output if o))
    graph = onnx.helper.make_graph(
        nodes,
        "region",
        [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(feeds[k].dtype), feeds[k].shape)
         for k in region.inputs],
        [onnx.ValueInfoProto(name=name) for name in made],
        [w for w in model.graph.initializer if w.name in used],
    )  # fmt: skip
    sub = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    sub.functions.extend(model.functions)
    return sub


def run_region(
    model: onnx.ModelProto, region: Region, feeds: Mapping[str, np.ndarray], provider: str, budget: int
) -> dict[str, np.ndarray] | str:
    """Every value the region's nodes compute, run alone on ``feeds`` (one per region
    input); where the region cannot run alone, why (ONNX Runtime refuses it or its inputs)."""
    try:
        sub = region_model(model, region, feeds)
        made = [o.name for o in sub.graph.output]
        session = load_session(sub.SerializeToString(), provider, level="disabled", budget=budget)
        return dict(zip(made, session.run(made, {k: feeds[k] for k in region.inputs}), strict=True))
    except Exception as e:  # noqa: BLE001 - ONNX Runtime and onnx raise their own classes
        return first_line(e)
