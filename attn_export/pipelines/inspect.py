"""``attn-export inspect``: what an ONNX file holds, and whether a provider can run it."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.onnx_file import external_data_files, load_model_file
from attn_export.errors import GraphCheckError, RuntimeFailure
from attn_export.exporter.graph_checks import check_model, graph_shapes
from attn_export.runtimes.ort import load_session, require_provider

__all__ = ["InspectResult", "TensorInfo", "inspect_file"]


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int | str | None]


@dataclass
class InspectResult:
    """Facts about one ONNX file; ``kernels_ok`` is the only check."""

    file: str
    size_bytes: int
    sha256: str
    ir_version: int
    producer: str
    opsets: dict[str, int]
    metadata: dict[str, str]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    ops: dict[str, int]
    nodes: int
    parameters: int
    parameter_bytes: int
    initializers: int
    external_data: list[str]
    #: None when onnx.checker accepts the model, else its message, on one line.
    checker_problem: str | None
    provider: str
    kernels_ok: bool
    kernel_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InspectResult:
        tensors = {k: [TensorInfo(**t) for t in d[k]] for k in ("inputs", "outputs")}
        return cls(**{**d, **tensors})


def _dtype(elem_type: int) -> str:
    """numpy's name for an element type, else ONNX's, else the number (a hostile file may hold any)."""
    with contextlib.suppress(KeyError, ValueError):
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    with contextlib.suppress(ValueError):
        if elem_type:
            return onnx.TensorProto.DataType.Name(elem_type).lower()
    return f"unknown ({elem_type})"


def _tensor_infos(values: Any, shapes: dict[str, tuple[int | str | None, ...]]) -> list[TensorInfo]:
    return [TensorInfo(v.name, _dtype(v.type.tensor_type.elem_type), list(shapes[v.name])) for v in values]


def _kernel_check(path: Path, provider: str) -> tuple[bool, str | None]:
    """Load the model unoptimized with fallback to CPU disabled: a node without a kernel
    on the provider makes the session fail, naming the op."""
    require_provider(provider)
    try:
        load_session(path, provider, level="disabled", no_fallback=True)
    except RuntimeFailure as e:
        return False, str(e)
    return True, None


def _elements(dims: Sequence[int]) -> int:
    """Elements of an initializer, in Python ints (numpy's int64 product overflows on hostile
    dims); a negative dim, which the checker rejects, counts as none."""
    return math.prod(dims) if all(d >= 0 for d in dims) else 0


def _itemsize(data_type: int) -> int:
    try:
        return int(onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)
    except (KeyError, ValueError, TypeError):
        return 0


def inspect_file(path: Path, provider: str = "cpu") -> InspectResult:
    """Read ``path`` safely (no external data outside its folder) and describe it."""
    proto = load_model_file(path)
    shapes = graph_shapes(proto)
    counts = [(_elements(i.dims), _itemsize(i.data_type)) for i in proto.graph.initializer]
    ops = Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)
    try:
        check_model(proto, path.name, path)
        checker_problem = None
        ok, problem = _kernel_check(path, provider)
    except GraphCheckError as e:
        checker_problem = str(e)
        # a model the checker rejects is never handed to ONNX Runtime
        ok, problem = False, "not checked: onnx.checker rejected the model"
    return InspectResult(
        file=str(path),
        size_bytes=path.stat().st_size,
        sha256=sha256_file(path),
        ir_version=proto.ir_version,
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        opsets={(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
        metadata={p.key: p.value for p in proto.metadata_props},
        inputs=_tensor_infos(proto.graph.input, shapes),
        outputs=_tensor_infos(proto.graph.output, shapes),
        ops=dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        nodes=len(proto.graph.node),
        parameters=sum(n for n, _ in counts),
        parameter_bytes=sum(n * size for n, size in counts),
        initializers=len(counts),
        external_data=external_data_files(proto),
        checker_problem=checker_problem,
        provider=provider,
        kernels_ok=ok,
        kernel_problem=problem,
    )
