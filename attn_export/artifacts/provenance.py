"""Where a graph came from: the versions of the tools that shape it, recorded in its
metadata, its manifest entry, its build key and bench reports."""

from __future__ import annotations

import importlib.metadata

import onnx

from attn_export import __version__
from attn_export._deps import require

__all__ = ["versions"]


def _version(package: str) -> str:
    """A package's version as its installed metadata says, which needs no import (torch and
    onnxscript take seconds, which a build with nothing to do would spend on them alone);
    else the module's own."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(require(package, "building"), "__version__", "unknown"))


def versions() -> dict[str, str]:
    """Versions that shape an exported graph; recorded in metadata and the manifest."""
    import onnxruntime  # its distribution is onnxruntime or onnxruntime-gpu: the module knows

    return {
        "attn_export": __version__,
        "torch": _version("torch"),
        "onnx": onnx.__version__,
        "onnxscript": _version("onnxscript"),
        "onnxruntime": onnxruntime.__version__,
    }
