"""Stage: export a PyTorch module to an ONNX ModelProto with the spec's dynamic axes."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx

from attn_export._deps import require
from attn_export.errors import ExportFailure, first_line
from attn_export.spec import ModelSpec

__all__ = ["export_onnx", "stamp_metadata"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporters' progress prints, warnings and log lines; errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _axes(shape: tuple[int | str, ...]) -> dict[int, str]:
    return {i: d for i, d in enumerate(shape) if isinstance(d, str)}


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
    torch = require("torch", "exporting")
    opset = opset or spec.opset
    exporter = exporter or spec.exporter
    args = tuple(
        v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
        for v in (example_feeds[t.name] for t in spec.inputs)
    )
    input_names = [t.name for t in spec.inputs]
    output_names = [t.name for t in spec.outputs]
    try:
        with _quiet(), torch.no_grad():
            if exporter == "dynamo":
                program = torch.onnx.export(
                    module,
                    args,
                    dynamo=True,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_shapes=tuple(_axes(t.shape) for t in spec.inputs),
                    verbose=False,
                    report=False,
                )
                proto = program.model_proto
            else:
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
                proto = onnx.load_from_string(buf.getvalue())
    except Exception as e:
        hint = "; or try --exporter torchscript" if exporter == "dynamo" else ""
        raise ExportFailure(
            f"{spec.name}: {exporter} export failed: {type(e).__name__}: {first_line(e)}"
            f" (rerun with --debug for the traceback{hint})"
        ) from e
    return proto


def stamp_metadata(proto: onnx.ModelProto, metadata: Mapping[str, str]) -> onnx.ModelProto:
    """Replace the model's metadata_props with ``metadata``, in sorted order (deterministic)."""
    del proto.metadata_props[:]
    for key in sorted(metadata):
        entry = proto.metadata_props.add()
        entry.key = key
        entry.value = metadata[key]
    return proto
