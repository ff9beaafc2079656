"""Where a graph came from: the versions of the tools that shape it, recorded in its
metadata, its manifest entry, its build key and bench reports."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import onnx

from attn_export import __version__
from attn_export._deps import require

__all__ = ["versions"]


def _version(package: str) -> str:
    """The version of the package that an import would load: the module's own where it is
    imported, else its installed metadata where that describes the same files, which needs
    no import (torch and onnxscript take seconds, which a build with nothing to do would
    spend on them alone); else the module's own, imported."""
    module = sys.modules.get(package)
    if module is None:
        try:
            dist = importlib.metadata.distribution(package)
            found = importlib.util.find_spec(package)
        except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
            found = None
        if found is not None and found.origin:
            described = Path(str(dist.locate_file(f"{package}/__init__.py")))
            if described.resolve() == Path(found.origin).resolve():
                return dist.version
        module = require(package, "building")
    return str(getattr(module, "__version__", "unknown"))


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
