"""Graph variants: faster or smaller graphs derived from one spec's export.

The table of variants is ``attn_export.spec.variants.VARIANTS``; each row names a module
here whose ``make(proto, provider) -> VariantGraph`` derives the variant. Every variant
gets its own copy of its source graph, so the order in which they are asked for never
changes a result.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import onnx

from attn_export.errors import UsageError
from attn_export.spec import VARIANTS

__all__ = ["ATTENTION_OPS", "VariantGraph", "make_variant", "op_counts"]

#: Attention ops a fused or attention-op graph must contain to be worth building.
ATTENTION_OPS = {"Attention", "com.microsoft.MultiHeadAttention", "com.microsoft.Attention"}


@dataclass
class VariantGraph:
    """A variant's graph, plus what the transformation did (recorded in the manifest)."""

    proto: onnx.ModelProto
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def op_counts(proto: onnx.ModelProto) -> Counter[str]:
    """Node counts by ``domain.op_type`` (plain op type in the default domain)."""
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)


def make_variant(variant: str, source: onnx.ModelProto, provider: str = "cpu") -> VariantGraph:
    """Derive ``variant`` from its own copy of ``source`` (the plain export, or the
    re-export at the opset the table names); ``source`` is never modified."""
    info = VARIANTS.get(variant)
    if info is None or info.chooser:
        raise UsageError(f"unknown variant '{variant}' (known: {', '.join(VARIANTS)})")
    copy = onnx.ModelProto()
    copy.CopyFrom(source)
    if info.maker is None:
        return VariantGraph(copy)
    maker = importlib.import_module(f"{__name__}.{info.maker}")
    with contextlib.redirect_stdout(io.StringIO()):  # quantization and fusion tools print progress
        graph: VariantGraph = maker.make(copy, provider)
    return graph
