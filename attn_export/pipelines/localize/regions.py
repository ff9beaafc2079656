"""The graph cut into regions, one per FX node: the ONNX nodes the dynamo exporter made from
it (its ``pkg.torch.onnx.fx_node`` metadata), the values they read from outside, and the
value that holds the FX node's result. Each region can run alone on given inputs, which is
how it is teacher-forced: fed PyTorch's values, its error is its own, not inherited."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from attn_export.errors import RunTimeout, first_line
from attn_export.exporter.stack import innermost_line
from attn_export.pipelines.localize.values import evaluate
from attn_export.runtimes.target import Target

__all__ = ["Region", "graph_regions", "has_fx_metadata", "region_model", "run_region", "unpaired"]

_FX_NAME = re.compile(r"%(\S+) :")
_TARGET = re.compile(r"target=(?:torch\.ops\.)?([\w.]+)")


@dataclass(frozen=True)
class Region:
    """The ONNX nodes made from one FX node, or a fused region: nodes a variant made in
    place of several FX nodes (a node without export metadata, or one whose op the plain
    graph never made from its FX node), with what they read and where they came from."""

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
    #: Every (value, FX node) the region computes that PyTorch has a value for; the first
    #: is (``value``, ``fx_node``).
    compared: tuple[tuple[str, str], ...] = ()
    #: The FX nodes the region stands for, in graph order: its own, and for a fused
    #: region those of the plain graph's nodes between its inputs and its values.
    covers: tuple[str, ...] = ()
    #: The node that computes each value the region makes.
    producers: Mapping[str, str] = field(default_factory=dict)


def _metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _fx(meta: Mapping[str, str]) -> str:
    found = _FX_NAME.match(meta.get("pkg.torch.onnx.fx_node", ""))
    return found.group(1) if found else ""


def _module_path(scopes: str) -> str:
    """``module.q_proj`` from name scopes ``['', 'module', 'module.q_proj', 'linear']``."""
    try:
        names = ast.literal_eval(scopes) if scopes else []
    except (ValueError, SyntaxError):
        return ""
    return str(names[-2]) if isinstance(names, list) and len(names) >= 2 else ""


def has_fx_metadata(model: onnx.ModelProto) -> bool:
    """Whether any node names the FX node it was made from (the dynamo exporter's graphs)."""
    return any(p.key == "pkg.torch.onnx.fx_node" for n in model.graph.node for p in n.metadata_props)


def _node_metadata(model: onnx.ModelProto, plain: onnx.ModelProto | None) -> list[dict[str, str]]:
    """Each node's export metadata; a node that lost it (ONNX Runtime's optimizer keeps no
    metadata) takes that of the plain graph's node of the same name and op."""
    kept = {(n.name, n.domain, n.op_type): _metadata(n) for n in plain.graph.node} if plain is not None else {}
    out = []
    for node in model.graph.node:
        meta = _metadata(node)
        out.append(meta if _fx(meta) else kept.get((node.name, node.domain, node.op_type), meta))
    return out


class _Sets:
    """Union-find over node indices."""

    def __init__(self, items: Collection[int]) -> None:
        self.parent = {i: i for i in items}

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _covered(
    plain: onnx.ModelProto, producers: Mapping[str, int], made: Collection[str], inputs: Collection[str]
) -> list[int]:
    """The plain graph's nodes (by index; ``producers`` maps each of its values to the node
    making it) between ``inputs`` and ``made``: what a fused region stands for."""
    seen: set[int] = set()
    stack = [v for v in made if v in producers]
    while stack:
        value = stack.pop()
        index = producers.get(value)
        if value in inputs or index is None or index in seen:
            continue
        seen.add(index)
        stack.extend(plain.graph.node[index].input)
    return sorted(seen)


def graph_regions(
    model: onnx.ModelProto,
    output_nodes: Mapping[str, str],
    known: Collection[str] = (),
    plain: onnx.ModelProto | None = None,
) -> list[Region]:
    """The graph's regions in the order their first node runs; ``output_nodes`` maps each
    graph output to the FX node it holds (the exporter renames those values), ``known`` is
    every FX node PyTorch has a value for, and ``plain`` the plain export of the same
    module, for a variant (fused regions are mapped back to the FX nodes they replaced).

    Nodes made from one FX node form its region. The other nodes (fused, or without
    metadata) are cut into regions at the values PyTorch has. A region with none of those
    values joins the one region it feeds, if one: a quantized MatMul joins its bias Add, a
    Softmax kept in float32 joins the Cast back to float16 that holds its value."""
    nodes = list(model.graph.node)
    weights = {i.name for i in model.graph.initializer}
    meta = _node_metadata(model, plain)
    labels = [_fx(m) for m in meta]
    plain_nodes = list(plain.graph.node) if plain is not None else []
    plain_labels = [_fx(_metadata(n)) for n in plain_nodes]
    plain_producers = {o: i for i, n in enumerate(plain_nodes) for o in n.output if o}
    plain_ops: dict[str, set[tuple[str, str]]] = {}
    for label, n in zip(plain_labels, plain_nodes, strict=True):
        plain_ops.setdefault(label, set()).add((n.domain, n.op_type))

    def fx_of(value: str) -> str:
        fx = value if value in known else output_nodes.get(value, "")
        return fx if fx in known else ""

    fused = {
        i
        for i, n in enumerate(nodes)
        if not labels[i] or (labels[i] in plain_ops and (n.domain, n.op_type) not in plain_ops[labels[i]])
    }
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for value in n.input:
            readers.setdefault(value, []).append(i)
    sets = _Sets(fused)
    for i in fused:
        for value in nodes[i].input:
            j = producer.get(value)
            if j is not None and j in fused and not fx_of(value):
                sets.union(i, j)
    groups: dict[str, list[int]] = {}
    for i in range(len(nodes)):
        groups.setdefault(f"<{sets.find(i)}>" if i in fused else labels[i], []).append(i)
    group_of = {i: key for key, members in groups.items() for i in members}

    def outputs(key: str) -> list[str]:
        return [o for i in groups[key] for o in nodes[i].output if o]

    for key in list(groups):  # in graph order: a chain joins step by step
        outs = outputs(key)
        if any(fx_of(v) for v in outs):
            continue
        fed = {group_of[j] for v in outs for j in readers.get(v, ())} - {key}
        if len(fed) == 1:
            into = fed.pop()
            groups[into] = sorted(groups[into] + groups.pop(key))
            group_of.update({i: into for i in groups[into]})

    regions = []
    for key, members in groups.items():
        outs = outputs(key)
        read = dict.fromkeys(v for i in members for v in nodes[i].input if v and v not in outs and v not in weights)
        compared = [(v, fx_of(v)) for v in dict.fromkeys(outs) if fx_of(v)]
        compared.sort(key=lambda c: c[1] != key)  # the group's own FX node first
        fx = compared[0][1] if compared else ("" if key.startswith("<") else key)
        covers = [labels[i] for i in members if labels[i] in known] + [c[1] for c in compared]
        if plain is not None and any(i in fused for i in members):
            walked = [plain_labels[j] for j in _covered(plain, plain_producers, outs, read)]
            covers = [label for label in walked if label in known] + covers
        own = next((meta[i] for i in members if labels[i] == fx), {})
        target = _TARGET.search(own.get("pkg.torch.onnx.fx_node", ""))
        line = innermost_line(own.get("pkg.torch.onnx.stack_trace", ""))
        regions.append(
            Region(
                fx_node=fx,
                nodes=tuple(nodes[i].name or f"#{i} ({nodes[i].op_type})" for i in members),
                indices=tuple(members),
                ops=tuple(nodes[i].op_type for i in members),
                inputs=tuple(read),
                value=compared[0][0] if compared else "",
                target=target.group(1) if target else "",
                module_path=_module_path(own.get("pkg.torch.onnx.name_scopes", "")),
                source=line[0] if line else "",
                code=line[1] if line else "",
                compared=tuple(compared),
                covers=tuple(dict.fromkeys(covers)),
                producers={o: nodes[i].name for i in members for o in nodes[i].output if o},
            )
        )
    return sorted(regions, key=lambda r: r.indices[0])


def unpaired(
    model: onnx.ModelProto,
    regions: list[Region],
    output_nodes: Mapping[str, str],
    known: Collection[str],
    plain: onnx.ModelProto | None = None,
) -> str | None:
    """Why none of the graph's values can be paired with PyTorch's, or None where some can:
    its nodes name FX nodes PyTorch has a value of (``known``) besides the outputs', yet no
    value but the outputs (named for the spec's outputs, ``output_nodes``) is named for one
    (a tool renamed them after the export), or they name none of them at all (the graph of
    another module or export). Comparing the outputs alone would say nothing of where."""
    named = {_fx(m) for m in _node_metadata(model, plain)} & set(known)
    outputs = {o.name for o in model.graph.output}
    paired = {fx for r in regions for value, fx in r.compared if value not in outputs}
    if not named and not has_fx_metadata(model):
        return (
            "its nodes carry no FX node metadata, which torch.onnx's dynamo exporter writes and localize pairs "
            "by: a graph another tool wrote (onnxruntime-genai's model builder) is judged whole by verify, which "
            "names the output, case and step where it parts from PyTorch"
        )
    if not named:
        return "its nodes name none of the FX nodes PyTorch's values are of (the graph of another module or export?)"
    inner = named - set(output_nodes.values())
    if inner and not paired:
        return (
            f"its nodes name {len(inner)} FX nodes besides the outputs', but none of its values is named for one "
            "(renamed after the export?)"
        )
    return None


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
    model: onnx.ModelProto,
    region: Region,
    feeds: Mapping[str, np.ndarray],
    target: Target,
    budget: int,
    timeout_s: float,
) -> dict[str, np.ndarray] | str:
    """Every value the region's nodes compute, run alone on ``feeds`` (one per region
    input) on ``target``; where the region cannot run alone, why (the runtime refuses it
    or its inputs). A run past ``timeout_s`` seconds is RunTimeout naming the region: no
    refusal to judge around, a graph that does not end."""
    try:
        sub = region_model(model, region, feeds)
        made = [o.name for o in sub.graph.output]
        values = evaluate(sub, made, {k: feeds[k] for k in region.inputs}, target, budget, timeout_s)
        return dict(zip(made, values, strict=True))
    except RunTimeout as e:
        raise RunTimeout(f"region {_label(region)} on {target.label} {e}") from e
    except Exception as e:  # noqa: BLE001 - ONNX Runtime and onnx raise their own classes
        return first_line(e)


def _label(region: Region) -> str:
    """The region as a message names it: its FX node and ONNX nodes (a fused region has no FX node)."""
    nodes = ", ".join(region.nodes)
    return f"{region.fx_node} (ONNX nodes {nodes})" if region.fx_node else f"of ONNX nodes {nodes}"
