"""ort-optimized: the graph ONNX Runtime saves after optimizing it for ``provider``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from attn_export.exporter.variants import VariantGraph, op_counts
from attn_export.runtimes.ort import load_session


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "optimized.onnx"
        # EXTENDED keeps the graph portable across machines (ALL adds CPU-layout transforms).
        load_session(proto.SerializeToString(), provider, level="extended", optimized_path=dst)
        out = onnx.load(dst)
    return VariantGraph(out, {"provider": provider, "level": "extended", "ops": dict(op_counts(out))})
