"""Stage: export a PyTorch module to an ONNX ModelProto with the spec's dynamic axes.

The exporter is given the spec's dim ranges. Where the module's Python code narrows or
fixes one (a branch on a shape, a Python int taken from a tensor), the export fails and
names the module's source line, unless the spec sets ``accept_guards = true``: a graph
traced through such code is right only for part of the range it was declared for.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from attn_export._deps import require
from attn_export.errors import ExportFailure, NondeterministicModule, RuntimeFailure, SpecError, first_line
from attn_export.exporter.graph_checks import name_dims
from attn_export.exporter.guards import accepted_guards, refuse_fixed_dims
from attn_export.exporter.random_ops import refuse_random_ops
from attn_export.exporter.stack import import_path, module_code, root_cause
from attn_export.exporter.state_updates import refuse_state_updates
from attn_export.model_spec import Guard, ModelSpec
from attn_export.model_spec.inputs import int_values
from attn_export.model_spec.shapes import sizes_from_feeds
from attn_export.runtimes.base import describe_inputs

__all__ = [
    "Exported",
    "export_onnx",
    "export_onnx_program",
    "export_program",
    "quieted",
    "refuse_misfit",
    "stamp_metadata",
]

#: Logger on which torch's shape environment reports each guard it adds, with its source.
_GUARD_LOGGER = "torch.fx.experimental.symbolic_shapes"
#: Loggers that print past ``redirect_stderr`` (torch's handler holds the real stream), and
#: the level each is held to: a failed op's traceback from the fake-tensor run is the export's
#: failure, which we report in one line.
_QUIETED = {
    "torch.onnx": logging.ERROR,
    "torch._subclasses.fake_tensor": logging.CRITICAL,
    "torch.export._trace": logging.CRITICAL,
}
#: TracerWarnings that mean a traced value was frozen into the graph.
_FROZEN = re.compile(r"Python (boolean|integer|float|index)|Converting a tensor to a Python")


class _GuardSources(logging.Handler):
    """Collects the user source lines (outside torch) at which the exporter added guards,
    and each guard's line (as its module is imported) by the guard as torch prints it."""

    def __init__(self, torch_dir: str, roots: tuple[str, ...]) -> None:
        super().__init__(logging.INFO)
        self.torch_dir = torch_dir
        self.roots = roots
        self.lines: list[str] = []
        self.located: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "guard added" not in str(record.msg) or not isinstance(record.args, tuple):
            return
        for arg in record.args:
            frame = getattr(arg, "framework_loc", None)
            filename = getattr(frame, "filename", None)
            if frame is not None and filename and not os.path.abspath(filename).startswith(self.torch_dir):
                code = (getattr(frame, "line", "") or "").strip()
                self.lines.append(f"{filename}:{frame.lineno}" + (f" `{code}`" if code else ""))
                if len(record.args) > 1:  # (prefix, guard, where, ...)
                    at = f"{import_path(filename, *self.roots)}:{frame.lineno}" + (f" `{code}`" if code else "")
                    self.located[str(record.args[1])] = at


@contextlib.contextmanager
def quieted(torch_dir: str, roots: tuple[str, ...]) -> Iterator[tuple[_GuardSources, list[warnings.WarningMessage]]]:
    """Silence the exporters' prints, warnings and log lines, keeping what we judge by:
    guard sources (named from ``roots`` where they lie there) and warnings."""
    quieted = {logging.getLogger(name): level for name, level in _QUIETED.items()}
    guard_logger = logging.getLogger(_GUARD_LOGGER)
    saved = ({lg: lg.level for lg in quieted}, guard_logger.level, guard_logger.propagate, guard_logger.handlers)
    for lg, level in quieted.items():
        lg.setLevel(level)
    guard_logger.setLevel(logging.INFO)
    guard_logger.propagate = False
    guards = _GuardSources(torch_dir, roots)
    guard_logger.handlers = [guards]  # torch's own handler would print every guard
    sink = io.StringIO()
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("always")
            yield guards, caught
    finally:
        for lg, level in saved[0].items():
            lg.setLevel(level)
        guard_logger.setLevel(saved[1])
        guard_logger.propagate = saved[2]
        guard_logger.handlers = saved[3]


#: torch.onnx's tables of ONNX functions, by opset and what they were made from
#: (``_one_registry_per_opset``); the lock keeps one export at a time in the patched window.
_REGISTRIES: dict[tuple[object, ...], Any] = {}
_PATCHED = threading.RLock()


def _table_sources() -> tuple[object, ...]:
    """What torch.onnx's table holds besides the opset's: the functions of torch's torchlib
    and of onnxscript's (a module may register its own) and whether torchvision's ops exist."""
    from onnxscript.function_libs.torch_lib.registration import default_registry
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    onnxscript_functions = sum(len(f.overloads) + len(f.complex) for f in default_registry.values())
    return len(_torchlib_registry._registry), onnxscript_functions, "torchvision" in sys.modules


@contextlib.contextmanager
def _one_registry_per_opset() -> Iterator[None]:
    """torch.onnx.export builds its table of ONNX functions from torchlib anew on every call,
    a second or more of each export, though the export only reads it: within our exports,
    one table is built per opset and process, and again when the functions it is made from
    change. Other callers of torch.onnx (which may add to the table) get their own, as before."""
    try:
        from torch.onnx._internal.exporter import _registration

        registry = _registration.ONNXRegistry
        original = registry.__dict__["from_torchlib"]
        build, default_opset = original.__func__, _registration._constants.TORCHLIB_OPSET
        _table_sources()
    except (ImportError, AttributeError, KeyError):  # another torch or onnxscript: export as it does
        yield
        return

    def shared(cls: Any, opset_version: int = default_opset) -> Any:
        key = (opset_version, *_table_sources())
        if key not in _REGISTRIES:
            table = build(cls, opset_version)
            _REGISTRIES[(opset_version, *_table_sources())] = table  # with what building it imported
            return table
        return _REGISTRIES[key]

    with _PATCHED:
        registry.from_torchlib = classmethod(shared)
        try:
            yield
        finally:
            registry.from_torchlib = original


def _axes(shape: tuple[int | str, ...]) -> dict[int, str]:
    return {i: d for i, d in enumerate(shape) if isinstance(d, str)}


def _where(lines: list[str]) -> str:
    unique = list(dict.fromkeys(lines))
    return f" (at {'; '.join(unique[:3])})" if unique else ""


def _dim_shapes(torch: Any, spec: ModelSpec, module: Any) -> tuple[Any, ...]:
    """``dynamic_shapes`` for torch.export: one ``Dim`` per spec dim, with its range."""
    dims = {name: torch.export.Dim(name, min=r.min, max=r.max) for name, r in spec.dims.items()}
    return _by_parameter(module, tuple({i: dims[d] for i, d in _axes(t.shape).items()} for t in spec.inputs))


def _by_parameter(module: Any, shapes: tuple[dict[int, Any], ...]) -> tuple[Any, ...]:
    """``shapes`` grouped as torch.export matches them to forward's parameters: the inputs a
    ``*args`` parameter takes are one tuple (a decoder's ``*past``, whose layer count no
    signature fixes)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return shapes
    star = next((i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL), None)
    return shapes if star is None or star > len(shapes) else (*shapes[:star], shapes[star:])


def _dynamo(torch: Any, module: Any, args: tuple[Any, ...], spec: ModelSpec, guards: _GuardSources) -> Any:
    """torch.export with the spec's ranges; a narrowed or fixed range fails here."""
    try:
        return torch.export.export(module, args, dynamic_shapes=_dim_shapes(torch, spec, module), strict=False)
    except Exception as e:
        text = str(e)
        if "Constraints violated" not in text and "specialized" not in text:
            raise
        found = [line.strip(" -") for line in text.splitlines() if line.strip().startswith("- ")]
        why = found[0] if found else first_line(e)
        raise ExportFailure(
            f"{spec.name}: the module's Python code does not hold for the whole declared range: {why}"
            f"{_where(guards.lines)}; remove the shape-dependent code, narrow [dims], or set "
            "accept_guards = true in the spec"
        ) from None


def _frozen_values(caught: list[warnings.WarningMessage], spec: ModelSpec) -> None:
    """TracerWarnings about Python values taken from tensors: the trace froze them."""
    frozen = [w for w in caught if type(w.message).__name__ == "TracerWarning" and _FROZEN.search(str(w.message))]
    if frozen and not spec.accept_guards:
        w = frozen[0]
        raise ExportFailure(
            f"{spec.name}: the trace froze a value computed from a tensor at {w.filename}:{w.lineno}: "
            f"{str(w.message).splitlines()[0]}; the graph keeps the example's value for every shape "
            "(set accept_guards = true in the spec to build it anyway)"
        )


def export_onnx(
    module: Any,
    spec: ModelSpec,
    example_feeds: Mapping[str, Any],
    *,
    opset: int | None = None,
    exporter: str | None = None,
) -> onnx.ModelProto:
    """Export ``module`` called with ``example_feeds`` (numpy arrays or torch tensors,
    passed positionally in spec order).

    The examples must give every symbolic dim its own size (``shapes.example_sizes``);
    the caller checks the result with ``graph_checks.check_dynamic_axes``.
    """
    return export_onnx_program(module, spec, example_feeds, opset=opset, exporter=exporter).proto


def export_onnx_program(
    module: Any,
    spec: ModelSpec,
    example_feeds: Mapping[str, Any],
    *,
    opset: int | None = None,
    exporter: str | None = None,
) -> Exported:
    """``export_onnx``'s graph, with the FX program and the guards behind it."""
    exported = _export(module, spec, example_feeds, opset or spec.opset, exporter or spec.exporter)
    name_dims(exported.proto, spec.inputs, spec.outputs, spec.dims)
    return exported


def export_program(module: Any, spec: ModelSpec, example_feeds: Mapping[str, Any], *, opset: int) -> Any:
    """The FX program the dynamo exporter turned into ONNX, as ``export_onnx`` exports it:
    its node names are the ``pkg.torch.onnx.fx_node`` names in the graph's metadata."""
    return _export(module, spec, example_feeds, opset, "dynamo").program


@dataclass(frozen=True)
class Exported:
    """An export: its graph, the FX program it was converted from (``export_program``; None
    from the torchscript exporter) and the guards a spec that accepts them let through."""

    proto: onnx.ModelProto
    program: Any = None
    guards: tuple[Guard, ...] = ()


def _export(module: Any, spec: ModelSpec, example_feeds: Mapping[str, Any], opset: int, exporter: str) -> Exported:
    torch = require("torch", "exporting")
    linecache.checkcache()  # the graph's stack traces quote source lines: not a file's older text
    args = _args(torch, spec, example_feeds)
    input_names = [t.name for t in spec.inputs]
    output_names = [t.name for t in spec.outputs]
    torch_dir = os.path.dirname(os.path.abspath(str(torch.__file__)))
    roots = (spec.search_path,) if spec.search_path else ()
    try:
        with quieted(torch_dir, roots) as (guards, caught), torch.no_grad():
            if exporter == "dynamo":
                # a spec that accepts guards leaves the trace to torch.onnx.export, which narrows
                # the ranges where the code does: tracing it here first would only fail
                program = None if spec.accept_guards else _dynamo(torch, module, args, spec, guards)
                if program is not None:  # before the conversion, which fails on a draw it cannot write
                    refuse_random_ops(program, spec.name)
                    refuse_state_updates(program, spec.name, caught)
                with _one_registry_per_opset():
                    result = torch.onnx.export(
                        module if program is None else program,
                        args,
                        dynamo=True,
                        opset_version=opset,
                        input_names=input_names,
                        output_names=output_names,
                        # names the graph's symbolic dims after the spec's
                        dynamic_shapes=_dim_shapes(torch, spec, module),
                        verbose=False,
                        report=False,
                    )
                if program is not None:
                    return Exported(result.model_proto, result.exported_program)
                # exported by torch.onnx's own export, which narrowed what the code needs
                program = result.exported_program
                refuse_random_ops(program, spec.name)
                refuse_state_updates(program, spec.name, caught)
                refuse_fixed_dims(program, spec, guards.located)
                sizes = sizes_from_feeds(spec.inputs, {t.name: a.shape for t, a in zip(spec.inputs, args, strict=True)})
                return Exported(result.model_proto, program, accepted_guards(program, spec, sizes, guards.located))
            buf = io.BytesIO()
            axes = {t.name: _axes(t.shape) for t in spec.inputs + spec.outputs}
            torch.onnx.export(
                module,
                args,
                buf,
                dynamo=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes={k: v for k, v in axes.items() if v},
                do_constant_folding=True,
            )
            _frozen_values(caught, spec)
            return Exported(onnx.load_from_string(buf.getvalue()))
    except (ExportFailure, NondeterministicModule):
        raise
    except Exception as e:
        refuse_misfit(module, spec, example_feeds)
        hint = "; or try --exporter torchscript" if exporter == "dynamo" else ""
        cause, at = root_cause(e, module_code(spec), *roots)
        if "DataDependent" in type(cause).__name__:
            hint = (
                "; a branch on a tensor's values, not its shape, is not a graph: write it with torch.where "
                "or torch.cond" + hint
            )
        raise ExportFailure(
            f"{spec.name}: {exporter} export failed: {type(cause).__name__}: {first_line(cause)}{at}"
            f" (rerun with --debug for the traceback{hint})"
        ) from e


def _args(torch: Any, spec: ModelSpec, feeds: Mapping[str, Any]) -> tuple[Any, ...]:
    """``feeds`` as tensors, in the spec's input order (forward()'s)."""
    return tuple(
        v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
        for v in (feeds[t.name] for t in spec.inputs)
    )


def refuse_misfit(module: Any, spec: ModelSpec, example_feeds: Mapping[str, Any]) -> None:
    """A module that fails in PyTorch on the spec's example inputs was given inputs it does
    not take (a wrong size or dtype, an id past its embedding): a spec error, which no
    exporter fixes and no later stage should report as its own failure. The module's line
    is named: where the module itself is wrong, that is where to look."""
    torch = require("torch", "exporting")
    args = _args(torch, spec, example_feeds)
    try:
        with torch.no_grad(), quieted("", ()):
            module(*args)
    except SystemExit as e:  # the module's own doing, whatever its inputs
        raise RuntimeFailure(f"{spec.name}: forward raised SystemExit: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the module raises, the spec's inputs caused it
        shapes = describe_inputs(spec.inputs, args, {t.name: int_values(spec, t) for t in spec.inputs if t.is_ids})
        _, at = root_cause(e, module_code(spec), spec.search_path or "")
        raise SpecError(
            f"{spec.name}: the module fails in PyTorch on inputs shaped as the spec declares them ({shapes}): "
            f"{type(e).__name__}: {first_line(e)}{at}; check [[inputs]] against the module's forward"
        ) from None


def stamp_metadata(proto: onnx.ModelProto, metadata: Mapping[str, str]) -> onnx.ModelProto:
    """Replace the model's metadata_props with ``metadata``, in sorted order (deterministic)."""
    del proto.metadata_props[:]
    for key in sorted(metadata):
        entry = proto.metadata_props.add()
        entry.key = key
        entry.value = metadata[key]
    return proto
