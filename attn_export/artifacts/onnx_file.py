"""Reading ONNX files that may come from anywhere: every malformed file is one clear
ArtifactError, and external data that points outside the model's folder or past its file,
or names bytes another tensor names, is refused before anything reads it; what is read
stays within the memory budget."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from onnx.external_data_helper import load_external_data_for_model, load_external_data_for_tensor

from attn_export.artifacts.files import read_regular, resolved
from attn_export.errors import ArtifactError
from attn_export.model_spec.memory import format_bytes, memory_budget

__all__ = [
    "check_external_data",
    "default_opset",
    "external_data_files",
    "load_model_file",
    "max_supported_opset",
    "with_small_data",
]

#: protobuf cannot parse a message this large; bigger models keep their weights as external data.
MAX_MODEL_BYTES = 2 << 30


def max_supported_opset() -> int:
    """The newest default-domain opset the installed onnx package defines; a model stamped
    with a newer one cannot be checked here (ONNX Runtime refuses unknown opsets too)."""
    return onnx.defs.onnx_opset_version()


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _model_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a model holds: its graph's (initializers, sparse ones, node attributes,
    subgraphs) and its functions' nodes'."""
    yield from _tensors(proto.graph)
    for function in proto.functions:
        yield from _node_tensors(function.node)


def _external(proto: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """(location, tensor) of each tensor a model keeps outside its file."""
    for t in _model_tensors(proto):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            yield next((e.value for e in t.external_data if e.key == "location"), ""), t


def external_data_files(proto: onnx.ModelProto) -> list[str]:
    """The external data locations a model names, in order of first use."""
    return list(dict.fromkeys(location for location, _ in _external(proto)))


def with_small_data(
    proto: onnx.ModelProto, model_dir: Path, limit: int = 1 << 16, budget: int | None = None
) -> onnx.ModelProto:
    """A copy of ``proto`` holding the external tensors of at most ``limit`` bytes: shape
    inference reads the values of shape inputs (a Reshape's target, a Slice's ends), never
    the weights, and cannot read external data itself. Locations and spans are checked
    first (``check_external_data``); a tensor is small by its dims and by the bytes it
    names, and all read together stay within ``budget`` (default: ``memory_budget``)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    small = []
    for (_, t), (_, length) in zip(list(_external(copy)), check_external_data(proto, model_dir), strict=True):
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 0
        if itemsize and math.prod(t.dims) * itemsize <= limit and length <= limit:
            small.append((t, length))
    read = sum(length for _, length in small)
    _within(read, budget, f"{model_dir}: its external tensors of up to {limit} bytes, read for shape inference, are")
    for t, _ in small:
        load_external_data_for_tensor(t, str(model_dir))
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    return copy


def _within(named: int, budget: int | None, what: str) -> None:
    """Refuse to read ``named`` bytes of external data over ``budget`` (default: ``memory_budget``)."""
    cap = budget or memory_budget()
    if named > cap:
        raise ArtifactError(f"{what} {format_bytes(named)}, over the memory budget of {format_bytes(cap)}")


def _span(location: str, t: onnx.TensorProto, size: int) -> tuple[int, int]:
    """A tensor's offset and length, inside its external data file of ``size`` bytes."""
    keys = {e.key: e.value for e in t.external_data}
    try:
        offset = int(keys.get("offset", 0))
        length = int(keys["length"]) if "length" in keys else size - offset
    except ValueError:
        raise ArtifactError(f"external data of tensor '{t.name}': offset or length is not an integer") from None
    if offset < 0 or length < 0 or offset + length > size:
        raise ArtifactError(
            f"external data of tensor '{t.name}': bytes {offset}..{offset + length} lie outside {location!r} "
            f"({size} bytes)"
        )
    return offset, length


def _distinct(spans: list[tuple[int, int]]) -> int:
    """How many bytes the (offset, length) spans cover, each counted once."""
    covered = end = 0
    for offset, length in sorted(spans):
        covered += max(0, offset + length - max(offset, end))
        end = max(end, offset + length)
    return covered


def check_external_data(proto: onnx.ModelProto, model_dir: Path) -> list[tuple[onnx.TensorProto, int]]:
    """Each external tensor with the bytes it names, refusing data outside ``model_dir``
    (``..``, absolute paths, symlinks out), past its file's end, or named twice: a save
    writes each tensor's bytes once, and thousands of tensors naming the same bytes made a
    graph of 1 MB read gigabytes."""
    root = resolved(model_dir)
    sizes = {}
    for location in external_data_files(proto):
        candidate = Path(location)
        if not location or candidate.is_absolute() or ".." in candidate.parts:
            raise ArtifactError(f"refused external data location {location!r}: it must be a file inside {model_dir}")
        target = resolved(root / candidate)
        if not target.is_relative_to(root):
            raise ArtifactError(f"refused external data location {location!r}: it resolves outside {model_dir}")
        if not target.is_file():
            raise ArtifactError(f"external data file {location!r} is missing next to the model")
        sizes[location] = target.stat().st_size
    spans: dict[str, list[tuple[int, int]]] = {location: [] for location in sizes}
    found = []
    for location, t in _external(proto):
        offset, length = _span(location, t, sizes[location])
        spans[location].append((offset, length))
        found.append((t, length))
    for location, named in spans.items():
        total, distinct = sum(length for _, length in named), _distinct(named)
        if total > distinct:
            raise ArtifactError(
                f"refused external data {location!r}: its {len(named)} tensors name {format_bytes(total)} in all, "
                f"{format_bytes(distinct)} of them distinct (tensors share bytes, which a save never writes)"
            )
    return found


def _strings_are_text(message: Message) -> bool:
    """ONNX strings are UTF-8; protobuf hands back bytes where a corrupt file holds others."""
    for field, value in message.ListFields():
        repeated = getattr(field, "is_repeated", None)  # protobuf >= 5; older ones have label
        if repeated is None:
            repeated = field.label == FieldDescriptor.LABEL_REPEATED
        values = value if repeated else [value]
        if field.type == FieldDescriptor.TYPE_STRING:
            if not all(isinstance(v, str) for v in values):
                return False
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not all(_strings_are_text(v) for v in values):
            return False
    return True


def default_opset(proto: onnx.ModelProto) -> int | None:
    """The version of the default (``ai.onnx``) domain the model imports, if any."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def load_model_file(path: Path, with_data: bool = False, budget: int | None = None) -> onnx.ModelProto:
    """Parse an ONNX file (a regular file, read no further than its size); refuse anything
    that is not a model this installation can run. External data stays outside unless
    ``with_data`` (a graph that is serialized again, to run it or a part of it: ONNX Runtime
    would look for its data in the current directory, not next to the file), read only
    within ``budget`` (default: the caller's, ``memory_budget``)."""
    data = read_regular(path, limit=MAX_MODEL_BYTES)
    if not data:
        raise ArtifactError(f"{path}: empty file, not an ONNX model")
    try:
        proto = onnx.load_from_string(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ArtifactError(
            f"{path}: not an ONNX model (does not parse as a ModelProto: truncated, corrupt or another format)"
        ) from e
    if not _strings_are_text(proto):
        raise ArtifactError(f"{path}: not an ONNX model (holds strings that are not valid UTF-8)")
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise ArtifactError(f"{path}: a protobuf, but not an ONNX model (no IR version, graph or opset)")
    opset = default_opset(proto)
    limit = max_supported_opset()
    if opset is not None and opset > limit:
        raise ArtifactError(f"{path}: uses opset {opset}, newer than this installation supports (up to {limit})")
    external = check_external_data(proto, path.parent)
    if external and with_data:
        _within(sum(length for _, length in external), budget, f"{path}: its external data is")
        try:
            load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError, RuntimeError) as e:
            raise ArtifactError(f"{path}: its external data cannot be read ({type(e).__name__}: {e})") from e
    return proto
