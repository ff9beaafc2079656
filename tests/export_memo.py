"""Export once per test process: the dynamo exporter takes seconds per module, and many tests
export the same module from the same spec (a shared zoo, then localize's and verify's own
exports of a graph given with --spec). An export is a pure function of the module (its
classes' source, its state), the spec, the example feeds, the opset and the exporter: a
second export of the same in this process is the first one's graph, copied, and its FX
program.

Only what can be keyed whole is kept: a module that does not pickle, a torchscript export and
a failed export run every time. What the key cannot see is a global or a helper in another
file that a forward reads: a test that patches one, or that tests the exporter itself, asks
for its own export with the ``fresh_export`` marker. The FX program is shared between hits
and holds the first module's tensors: no caller changes either.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import marshal
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from attn_export.exporter import torch_export

_KEPT: dict[str, Any] = {}
#: Set by the ``fresh_export`` marker's fixture for the test it marks.
BYPASS = [False]


def _source(cls: type) -> bytes:
    """The text of the file ``cls`` is defined in, as it is now (a test may edit it)."""
    try:
        return Path(inspect.getsourcefile(cls) or "").read_bytes()
    except (OSError, TypeError):
        return repr(cls).encode()


def _methods(cls: type) -> bytes:
    """The code of each method ``cls`` and its bases define: a method patched in place
    (``monkeypatch.setattr(cls, "forward", ...)``) changes it, not its file."""
    code = [
        name.encode() + marshal.dumps(value.__code__)
        for klass in cls.__mro__
        for name, value in sorted(vars(klass).items())
        if inspect.isfunction(value)
    ]
    return b"".join(code)


class _Pickler(pickle.Pickler):
    """Pickles a tensor as its dtype, shape, bytes' digest and which storage it shares (torch's
    own pickle of a tensor differs from one run to the next; tied weights export as one), and a
    class or function by its name (a module loaded again holds classes pickle would refuse as
    not the ones it imports; their source is keyed apart)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._storages: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        storage = self._storages.setdefault(obj.untyped_storage().data_ptr(), len(self._storages))
        return ("tensor", str(obj.dtype), tuple(obj.shape), storage, hashlib.sha256(data.tobytes()).hexdigest())

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, type) and not inspect.isfunction(obj) or obj.__module__ == "builtins":
            return NotImplemented
        if "<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__:
            raise pickle.PicklingError(f"{obj.__qualname__} has no name to key it by")
        return str, (f"{obj.__module__}.{obj.__qualname__}",)


def _pickled(module: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(module)
    return buffer.getvalue()


def _key(module: Any, spec: Any, feeds: Mapping[str, Any], opset: int, exporter: str) -> str | None:
    try:
        digest = hashlib.sha256(_pickled(module))
        values = {name: np.asarray(feeds[name]) for name in sorted(feeds)}
    except Exception:  # a lambda, a local class, a feed not an array: not keyed whole
        return None
    for cls in sorted({type(m) for m in module.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        digest.update(_source(cls))
        digest.update(_methods(cls))
    # a spec's mask conventions hold functions, whose repr holds their address
    digest.update(re.sub(r" at 0x[0-9a-f]+", "", repr((spec, opset, exporter))).encode())
    for name, value in values.items():
        digest.update(f"{name}{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _copied(exported: torch_export.Exported) -> torch_export.Exported:
    proto = onnx.ModelProto()
    proto.CopyFrom(exported.proto)
    return torch_export.Exported(proto, exported.program, exported.guards)


def install() -> None:
    """Route ``torch_export._export`` through the memo (conftest calls it once per process)."""
    export: Callable[..., torch_export.Exported] = torch_export._export

    def once(module: Any, spec: Any, feeds: Mapping[str, Any], opset: int, exporter: str) -> torch_export.Exported:
        key = None if BYPASS[0] or exporter != "dynamo" else _key(module, spec, feeds, opset, exporter)
        if key is None:
            return export(module, spec, feeds, opset, exporter)
        if key not in _KEPT:
            _KEPT[key] = _copied(export(module, spec, feeds, opset, exporter))
        return _copied(_KEPT[key])

    torch_export._export = once  # type: ignore[assignment]
