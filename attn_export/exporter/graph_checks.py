"""Stage: structural checks on an ONNX graph, run at build time and again by verify.

The dynamic-axis check reads the graph itself: each declared symbolic dim must be symbolic
on every input and output that uses it, one graph symbol per declared dim, no two declared
dims merged into one symbol, and that symbol named as the spec names the dim (a deploy
config reads these names). ``name_dims`` gives an export the spec's names.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from attn_export.artifacts.onnx_file import default_opset, external_data_files, with_small_data
from attn_export.errors import GraphCheckError, one_line
from attn_export.model_spec import DimRange, ModelSpec, TensorSpec
from attn_export.model_spec.cache import present_windows
from attn_export.runtimes.static_cache import graph_signature

__all__ = [
    "DEFAULT_DOMAINS",
    "RUNTIME_ONNX_OPS",
    "check_deterministic",
    "check_domains",
    "check_dynamic_axes",
    "check_float32_softmax",
    "check_model",
    "check_named_dims",
    "check_opset",
    "check_spec_axes",
    "graph_shapes",
    "name_dims",
    "only_shapes_rejected",
]

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Ops whose result is drawn at random on every run.
RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")
#: Operator domains ONNX Runtime runs out of the box: the ONNX standard ("" is ai.onnx), its
#: ML ops, and ONNX Runtime's contrib ops, which attn-export's fused variants use.
DEFAULT_DOMAINS = ("ai.onnx", "ai.onnx.ml", "com.microsoft")


def _same_as_input(ctx: onnx.shape_inference.InferenceContext) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))


def _simplified_layer_normalization() -> onnx.defs.OpSchema:
    """ONNX Runtime's RMS normalization, which it registers in the ONNX domain (version 1)
    and onnxscript's ORT fusions write: ``Y = X / sqrt(mean(X^2) + epsilon) * scale``."""
    schema = onnx.defs.OpSchema
    floats = ["tensor(float16)", "tensor(float)", "tensor(double)", "tensor(bfloat16)"]
    optional = schema.FormalParameterOption.Optional
    made = schema(
        "SimplifiedLayerNormalization",
        "",
        1,
        inputs=[schema.FormalParameter("X", "T"), schema.FormalParameter("scale", "T")],
        outputs=[schema.FormalParameter("Y", "T"), schema.FormalParameter("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], "")],
        attributes=[
            schema.Attribute(name, kind, "", required=False)
            for name, kind in (
                ("axis", schema.AttrType.INT),
                ("epsilon", schema.AttrType.FLOAT),
                ("stash_type", schema.AttrType.INT),
            )
        ],
    )
    made.set_type_and_shape_inference_function(_same_as_input)
    return made


#: Ops ONNX Runtime runs in the ONNX domain that ONNX has no schema for, and the schema
#: that lets onnx.checker check them (their inputs, attributes and types, and the shapes
#: that follow from them) instead of refusing the graph.
RUNTIME_ONNX_OPS = {"SimplifiedLayerNormalization": _simplified_layer_normalization}


def _register_runtime_ops(proto: onnx.ModelProto) -> None:
    """Register the schemas of ``RUNTIME_ONNX_OPS`` the graph uses, once per process."""
    used = {n.op_type for n in all_nodes(proto) if n.domain in ("", "ai.onnx")}
    for name in sorted(used & RUNTIME_ONNX_OPS.keys()):
        if not onnx.defs.has(name):
            onnx.defs.register_schema(RUNTIME_ONNX_OPS[name]())


def check_model(proto: onnx.ModelProto, name: str, path: Path | None = None) -> None:
    """onnx.checker with full_check (which includes strict shape inference).

    A model with external data is checked from ``path``, whose folder holds that data, and
    its shapes inferred with its tensors of up to 64 KiB read in (``with_small_data``: a
    Reshape's target; a larger shape input stays unread and fails inference); its data's
    locations are checked first (``onnx_file.check_external_data``), an ArtifactError. An op
    ONNX Runtime runs in the ONNX domain without an ONNX schema (``RUNTIME_ONNX_OPS``) is
    checked against the schema ONNX Runtime declares for it.
    """
    _register_runtime_ops(proto)
    # onnx's full check cannot read external data: such a file is checked from its folder,
    # then its shapes are inferred strictly with its small tensors read in (shape inputs)
    small = with_small_data(proto, path.parent) if path is not None and external_data_files(proto) else None
    try:
        if path is not None and small is not None:
            onnx.checker.check_model(str(path))
            onnx.shape_inference.infer_shapes(small, check_type=True, strict_mode=True)
        else:
            onnx.checker.check_model(proto, full_check=True)
    except Exception as e:  # ValidationError, InferenceError, or a decode error on a corrupt name
        raise GraphCheckError(f"{name}: onnx.checker rejected the graph: {one_line(e)}") from e


def only_shapes_rejected(proto: onnx.ModelProto, path: Path | None = None) -> bool:
    """Whether the graph passes onnx.checker's structural check, so that only its strict shape
    inference rejected it (``check_model``): a declared shape that contradicts what onnx infers
    (onnxruntime-genai's model builder declares a 1-D constant as rank 0), which ONNX
    Runtime, which does not read declared shapes of intermediate values, still runs."""
    try:
        onnx.checker.check_model(str(path) if path is not None and external_data_files(proto) else proto)
    except Exception:  # ValidationError, or a decode error on a corrupt name
        return False
    return True


def graph_shapes(proto: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    """Input and output shapes as the graph declares them: int, symbol name, or None."""
    shapes: dict[str, tuple[int | str | None, ...]] = {}
    for vi in list(proto.graph.input) + list(proto.graph.output):
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims)
    return shapes


def _terms(expression: str) -> list[str]:
    return sorted(term.strip() for term in expression.split("+"))


def name_dims(
    proto: onnx.ModelProto, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], dims: Mapping[str, DimRange]
) -> None:
    """Rename, in place, each graph symbol that stands for exactly one declared dim to the
    spec's name, and each sum the exporter wrote as an expression (``past_seq + seq``) to
    the sum dim's name when its terms are the parts'. Merged symbols and wrong sums keep
    their names, for ``check_dynamic_axes`` to report."""
    shapes = graph_shapes(proto)
    wants: dict[str, set[str]] = {}
    for t in [*inputs, *outputs]:
        for want, have in zip(t.shape, shapes.get(t.name, ()), strict=False):
            if isinstance(want, str) and isinstance(have, str):
                wants.setdefault(have, set()).add(want)
    rename = {have: next(iter(w)) for have, w in wants.items() if len(w) == 1 and _SYMBOL.fullmatch(have)}
    symbol = {want: have for have, want in rename.items()}
    for have, w in wants.items():
        want = next(iter(w))
        parts = dims[want].parts if want in dims else ()
        if len(w) == 1 and parts and _terms(have) == sorted(symbol.get(p, p) for p in parts):
            rename[have] = want
    values = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    for value in values:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
#: Longer dim expressions are not read (a graph is data: its names may be anything).
_MAX_EXPRESSION = 512
_CALLS = {"Max": max, "Min": min}


def _evaluate(node: ast.AST, sizes: Mapping[str, int]) -> int:
    """A graph's dim expression (symbols, integers, + - *, Max, Min) at ``sizes``; ValueError
    on anything else (it is read as data, never run)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id in sizes:
        return sizes[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, sizes), _evaluate(node.right, sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, sizes)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS and node.args:
        return _CALLS[node.func.id](_evaluate(a, sizes) for a in node.args)
    raise ValueError(f"not a dim expression: {ast.dump(node)}")


def _window_lengths(
    have: int | str | None, window: int, total: str, dims: Mapping[str, DimRange], symbol_of: Mapping[str, str]
) -> list[tuple[int, int]] | None:
    """(what the graph's axis gives, past + new) at sizes around the window and the ends of
    the ranges of the sum ``total``'s parts; None where the axis is no expression of them."""
    parts = dims[total].parts if total in dims else ()
    if len(parts) != 2 or have is None or len(str(have)) > _MAX_EXPRESSION:
        return None
    try:
        tree = ast.parse(str(have), mode="eval").body
    except SyntaxError:
        return None

    def near(r: DimRange) -> list[int]:
        picks = {r.min, r.max, *range(r.min, r.min + 3), *range(window - 3, window + 4)}
        return sorted(v for v in picks if r.min <= v <= r.max)

    out = []
    for a in near(dims[parts[0]]):
        for b in near(dims[parts[1]]):
            sizes = {symbol_of.get(parts[0], parts[0]): a, symbol_of.get(parts[1], parts[1]): b}
            try:
                out.append((_evaluate(tree, sizes | {symbol_of.get(total, total): a + b}), a + b))
            except ValueError:
                return None
    return out


def _kept_window(have: str, total: str, dims: Mapping[str, DimRange], symbol_of: Mapping[str, str]) -> int | None:
    """W where the axis is Min(W, past + new) at every size tried and below past + new at
    some: a sliding-window cache the spec does not declare."""
    lengths = _window_lengths(have, 0, total, dims, symbol_of)
    if not lengths:
        return None
    window = max(got for got, _ in lengths)
    capped = all(got == min(grown, window) for got, grown in lengths) and any(got < grown for got, grown in lengths)
    return window if capped and window > 0 else None


def check_signature(
    proto: onnx.ModelProto, name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> None:
    """The graph's inputs and outputs are the spec's, by name, rank, dtype and static sizes:
    else no feed made from the spec fits the graph, and nothing can be compared. Their order
    is free: every runtime feeds and reads them by name (onnxruntime-genai's model builder
    lists every layer's past key before the first past value)."""
    for kind, declared, spec_names in (
        ("inputs", [i.name for i in proto.graph.input], [t.name for t in inputs]),
        ("outputs", [o.name for o in proto.graph.output], [t.name for t in outputs]),
    ):
        if sorted(declared) != sorted(spec_names):
            raise GraphCheckError(f"{name}: graph {kind} {declared} != spec {kind} {spec_names}")
    shapes = graph_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)}
    for t in list(inputs) + list(outputs):
        kind, got = ("input" if t in inputs else "output"), shapes[t.name]
        if len(got) != len(t.shape):
            raise GraphCheckError(
                f"{name}: {kind} '{t.name}' has rank {len(got)} in the graph, spec says {len(t.shape)}"
            )
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(types[t.name])).name if types[t.name] else t.dtype
        if dtype != t.dtype:
            raise GraphCheckError(f"{name}: {kind} '{t.name}' is {dtype} in the graph, spec says {t.dtype}")
        for axis, (want, have) in enumerate(zip(t.shape, got, strict=True)):
            if isinstance(want, int) and isinstance(have, int) and have != want:
                raise GraphCheckError(f"{name}: {kind} '{t.name}' axis {axis} is {have} in the graph, spec says {want}")


def check_dynamic_axes(
    proto: onnx.ModelProto,
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    dims: Mapping[str, DimRange] | None = None,
    windows: Mapping[str, int] | None = None,
    own_names: bool = True,
) -> None:
    """Raise GraphCheckError naming the first axis that is static, unnamed or merged, or
    a sum dim (``dims``) whose graph expression is not the sum of its parts. ``windows``
    (``model_spec.cache.present_windows``): outputs whose axis 2 keeps at most that many positions,
    a sliding-window cache's presents. With ``own_names`` each dim must also carry the spec's
    name (what a build names it); without, a graph someone else exported may name each dim
    its own way, one name per dim."""
    dims, windows = dims or {}, windows or {}
    check_signature(proto, name, inputs, outputs)
    shapes = graph_shapes(proto)
    symbol_of: dict[str, str] = {}
    named_first: dict[str, tuple[str, str]] = {}  # a dim's graph name where first seen, and where
    dims_of_symbol: dict[str, str] = {}
    axes = [
        (t, "input" if t in inputs else "output", axis, want, have)
        for t in list(inputs) + list(outputs)
        for axis, (want, have) in enumerate(zip(t.shape, shapes[t.name], strict=True))
    ]
    sums = {k for k, r in dims.items() if r.parts}
    # a sum's terms are read as the graph names its parts: the parts' axes first
    for t, kind, axis, want, have in sorted(axes, key=lambda a: a[3] in sums):
        if kind == "output" and axis == 2 and t.name in windows and isinstance(want, str):
            # a sliding-window present: Min(window, total) however the exporter writes it
            window = windows[t.name]
            lengths = _window_lengths(have, window, want, dims, symbol_of)
            if lengths is None or any(got != min(grown, window) for got, grown in lengths):
                grows = lengths is not None and all(got == grown for got, grown in lengths)
                raise GraphCheckError(
                    f"{name}: output '{t.name}' axis 2 is {have!r} in the graph, but the spec's [cache] window "
                    f"keeps {window} positions, Min({window}, {want})"
                    + (": the graph's cache grows without bound" if grows else "")
                )
            continue
        if isinstance(want, int):
            if isinstance(have, str) and not own_names and _SYMBOL.fullmatch(have):
                continue  # another exporter's name for a fixed size (genai's kv_cache_dim): checked at run
            if isinstance(have, str):
                raise GraphCheckError(
                    f"{name}: {kind} '{t.name}' axis {axis} should be {want} but the graph computes it "
                    f"('{have}') from a constant the trace recorded: a size taken from the example "
                    "(e.g. a batch baked into a Reshape) became part of the graph"
                )
            if have != want:
                raise GraphCheckError(
                    f"{name}: {kind} '{t.name}' axis {axis} is {have!r} in the graph, spec says {want}"
                )
            continue
        if not isinstance(have, str):
            raise GraphCheckError(
                f"{name}: dynamic axis '{want}' of {kind} '{t.name}' (axis {axis}) is "
                f"{'static ' + str(have) if have else 'unnamed'} in the exported graph"
            )
        parts = dims[want].parts if want in dims else ()
        if parts and not _SYMBOL.fullmatch(have) and _terms(have) != sorted(symbol_of.get(p, p) for p in parts):
            kept = _kept_window(have, want, dims, symbol_of) if kind == "output" and axis == 2 else None
            raise GraphCheckError(
                f"{name}: {kind} '{t.name}' axis {axis} is '{have}' in the graph, but the spec "
                f"declares {want} = {' + '.join(parts)}"
                + (
                    f": the graph's cache keeps the newest {kept} positions, a sliding window; declare "
                    f"[cache] window = {kept}"
                    if kept
                    else ""
                )
            )
        # the exporter's sum of the parts' symbols is the sum dim, whatever it is named
        symbol = want if parts and not _SYMBOL.fullmatch(have) else have
        where = f"{kind} '{t.name}' (axis {axis})"
        first_name, first_where = named_first.setdefault(want, (have, where))
        if symbol_of.setdefault(want, symbol) != symbol:
            raise GraphCheckError(
                f"{name}: dynamic axis '{want}' is '{first_name}' on {first_where} and '{have}' on {where}"
            )
        other = dims_of_symbol.setdefault(symbol, want)
        if other != want:
            raise GraphCheckError(
                f"{name}: dynamic axes '{other}' and '{want}' were merged into one symbol "
                f"'{have}' ({kind} '{t.name}', axis {axis}); the exporter saw equal sizes for them"
            )
        if own_names and symbol != want:
            raise GraphCheckError(
                f"{name}: {kind} '{t.name}' axis {axis} is named '{have}' in the graph, but the spec names "
                f"that dim '{want}'; one name must serve both (a deploy config reads the graph's)"
            )


def check_spec_signature(proto: onnx.ModelProto, name: str, spec: ModelSpec) -> None:
    """``check_signature`` against the graph ``spec`` declares (``check_spec_axes``)."""
    check_signature(proto, name, *graph_signature(proto, spec.inputs, spec.outputs))


def check_spec_axes(proto: onnx.ModelProto, name: str, spec: ModelSpec, own_names: bool = True) -> None:
    """``check_dynamic_axes`` against everything ``spec`` declares for this graph: the
    signature of a cache updated in place (``runtimes.static_cache.graph_signature``), a
    sliding-window cache's presents."""
    inputs, outputs = graph_signature(proto, spec.inputs, spec.outputs)
    check_dynamic_axes(proto, name, inputs, outputs, spec.dims, present_windows(spec), own_names)


def check_float32_softmax(proto: onnx.ModelProto, name: str) -> None:
    """Refuse an fp16 graph whose Softmax computes in float16: the variant keeps it in
    float32, where a float16 exponential overflows on CUDA. ONNX Runtime's CPU runs a float16
    Softmax in float32 anyway, so no number on a CPU shows it: the graph itself is read."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
    }
    for node in proto.graph.node:
        if node.op_type == "Softmax" and types.get(node.input[0]) == onnx.TensorProto.FLOAT16:
            raise GraphCheckError(
                f"{name}: Softmax node '{node.name}' computes in float16; the fp16 variant keeps Softmax in float32 "
                "(a Cast to float before it): in float16 its exponentials overflow on CUDA"
            )
        precision = next((a.i for a in node.attribute if a.name == "softmax_precision"), None)
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and precision != onnx.TensorProto.FLOAT:
            raise GraphCheckError(
                f"{name}: Attention node '{node.name}' computes its softmax in float16 (softmax_precision "
                f"{precision}); the fp16 variant sets softmax_precision to float32 (1)"
            )


def _constant_true(proto: onnx.ModelProto, name: str) -> bool:
    """Whether tensor ``name`` is a constant (initializer or Constant node) holding True."""
    from onnx import numpy_helper

    for init in proto.graph.initializer:
        if init.name == name:
            return bool(numpy_helper.to_array(init).all())
    for n in proto.graph.node:
        if n.op_type == "Constant" and name in n.output:
            value = next((a for a in n.attribute if a.name == "value"), None)
            return value is not None and bool(numpy_helper.to_array(value.t).all())
    return False


def check_deterministic(proto: onnx.ModelProto, name: str) -> None:
    """Refuse a graph whose result depends on randomness or on training mode (a Dropout
    in training mode, random ops): two runs on the same inputs would differ. ONNX
    Runtime's optimizer may remove such a node at its default level; other runtimes and
    levels do not, so the graph itself is judged (its subgraphs and functions too)."""
    for n in all_nodes(proto):
        label = f"{n.op_type} node '{n.name or n.output[0]}'"
        if n.op_type in RANDOM_OPS:
            raise GraphCheckError(f"{name}: the graph holds a random op, {label}: its result changes on every run")
        if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2] and _constant_true(proto, n.input[2]):
            raise GraphCheckError(
                f"{name}: the graph holds {label} with training_mode = true: it drops values at random "
                "(the export runs the module in eval mode, so the module asks for it: look for "
                "F.dropout(..., training=True) or a dropout given training=True, and pass training=self.training)"
            )


def check_named_dims(proto: onnx.ModelProto, name: str) -> None:
    """Without a spec to say which axes are dynamic: refuse an input or output axis with
    neither a size nor a name (a deploy config cannot refer to it, and nothing says two
    such axes are the same)."""
    kinds = {vi.name: "input" for vi in proto.graph.input} | {vi.name: "output" for vi in proto.graph.output}
    for tensor, dims in graph_shapes(proto).items():
        for axis, dim in enumerate(dims):
            if dim is None:
                raise GraphCheckError(
                    f"{name}: {kinds[tensor]} '{tensor}' axis {axis} has neither a size nor a name in the graph"
                )


def check_opset(proto: onnx.ModelProto, name: str, lowest: int, highest: int) -> None:
    """Refuse a graph whose default-domain opset is outside ``lowest..highest``."""
    opset = default_opset(proto)
    if opset is not None and not lowest <= opset <= highest:
        raise GraphCheckError(f"{name}: opset {opset} is outside the allowed {lowest}..{highest}")


def all_nodes(proto: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node a run can execute: the graph's, its subgraphs' (``If``, ``Loop``, ``Scan``
    bodies) and model-local functions' bodies; a call of such a function is left out
    (its body is walked instead)."""
    local = {(f.domain, f.name) for f in proto.functions}

    def walk(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
        for n in nodes:
            if (n.domain, n.op_type) not in local:
                yield n
            for attr in n.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    yield from walk(sub.node)

    yield from walk(proto.graph.node)
    for f in proto.functions:
        yield from walk(f.node)


def check_domains(proto: onnx.ModelProto, name: str, allowed: Sequence[str]) -> None:
    """Refuse a node (in the graph, a subgraph or a model-local function) whose operator
    domain is not in ``allowed`` ("" and "ai.onnx" are one). Only domains that nodes use
    count: an optimizer may import domains it never uses."""
    permitted = {d or "ai.onnx" for d in allowed}
    for n in all_nodes(proto):
        domain = n.domain or "ai.onnx"
        if domain not in permitted:
            raise GraphCheckError(
                f"{name}: {n.op_type} node '{n.name or n.output[0]}' is in domain '{domain}', which is not "
                f"allowed ({', '.join(sorted(permitted))})"
            )
