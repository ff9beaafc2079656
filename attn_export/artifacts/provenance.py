"""Where a graph came from: the versions of the tools that shape it, recorded in its
metadata, its manifest entry, its build key and bench reports."""

from __future__ import annotations

import onnx

from attn_export import __version__
from attn_export._deps import require

__all__ = ["versions"]


def versions() -> dict[str, str]:
    """Versions that shape an exported graph; recorded in metadata and the manifest."""
    import onnxruntime

    torch = require("torch", "building")
    onnxscript = require("onnxscript", "building")
    return {
        "attn_export": __version__,
        "torch": str(torch.__version__),
        "onnx": onnx.__version__,
        "onnxscript": str(getattr(onnxscript, "__version__", "unknown")),
        "onnxruntime": onnxruntime.__version__,
    }
