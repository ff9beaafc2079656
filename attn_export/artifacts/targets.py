"""What a build folder is made for (``build --target``): one row per target, read by the
build's options, its CLI choices and the docs."""

from __future__ import annotations

__all__ = ["TARGETS"]

#: Each target and what it adds to the graphs, golden vectors and manifest every build writes.
TARGETS = {
    "onnx": "the graphs, golden vectors and manifest",
    "genai": "also genai/<graph>/: the graph and its genai_config.json, a folder onnxruntime-genai loads as it is",
}
