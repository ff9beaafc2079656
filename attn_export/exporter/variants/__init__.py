"""Graph variants: faster or smaller graphs derived from one spec's export.

The table of variants is ``attn_export.model_spec.variants.VARIANTS``; each row names a module
here whose ``make(proto, provider) -> VariantGraph`` derives the variant. Every variant
gets its own copy of its source graph, so the order in which they are asked for never
changes a result; in a chain (``ort-past+int8``) every link gets its own copy of the graph
the link before made.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import onnx

from attn_export.errors import AttnExportError, ExportFailure, UsageError, first_line
from attn_export.model_spec import VariantInfo, variant_chain

__all__ = ["ATTENTION_OPS", "VariantGraph", "make_variant", "op_counts"]

#: Attention ops a fused or attention-op graph must contain to be worth building.
ATTENTION_OPS = {"Attention", "com.microsoft.MultiHeadAttention", "com.microsoft.Attention"}


@dataclass
class VariantGraph:
    """A variant's graph, plus what the transformation did (recorded in the manifest)."""

    proto: onnx.ModelProto
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: Metadata the graph's file must carry for a runtime to run it (a static cache's interface).
    metadata: dict[str, str] = field(default_factory=dict)


def op_counts(proto: onnx.ModelProto) -> Counter[str]:
    """Node counts by ``domain.op_type`` (plain op type in the default domain)."""
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)


def _signature(proto: onnx.ModelProto) -> tuple[Counter[tuple[str, str, bytes]], Counter[int], bytes]:
    """What a link must change to have done anything, names and order aside: its ops with
    their attributes, the weights' types, the inputs' and outputs' types."""
    graph = proto.graph
    ops = Counter((n.domain, n.op_type, b"".join(a.SerializeToString() for a in n.attribute)) for n in graph.node)
    io = b"".join(v.type.SerializeToString() for v in (*graph.input, *graph.output))
    return ops, Counter(t.data_type for t in graph.initializer), io


def _make(info: VariantInfo, source: onnx.ModelProto, provider: str, positions: int | None) -> VariantGraph:
    """One variant from its own copy of ``source``; a maker that counts positions itself
    (``VariantInfo.counts_positions``) is told how many the graph reaches."""
    copy = onnx.ModelProto()
    copy.CopyFrom(source)
    if info.maker is None:
        return VariantGraph(copy)
    maker = importlib.import_module(f"{__name__}.{info.maker}")
    extra = {}
    if info.counts_positions:
        if positions is None:
            raise ExportFailure(f"variant {info.name} needs the number of positions its graph reaches")
        extra["positions"] = positions
    with contextlib.redirect_stdout(io.StringIO()):  # quantization and fusion tools print progress
        graph: VariantGraph = maker.make(copy, provider, **extra)
    return graph


def make_variant(
    variant: str, source: onnx.ModelProto, provider: str = "cpu", positions: int | None = None
) -> VariantGraph:
    """Derive ``variant`` from its own copy of ``source`` (the plain export, or the
    re-export at the opset the table names); ``source`` is never modified. ``positions``:
    how many positions the graph reaches, for a link that counts them itself.

    A chain (``ort-past+int8``, checked by ``variant_chain``) makes its first link from
    ``source`` and each next link from the graph the link before made; its info lists each
    link's, in order, under ``links``, and its warnings name their link. A link whose tool
    fails on that graph, or that leaves it as it was (the same ops with the same attributes,
    weight, input and output types: ``int8`` where no MatMul weight is left outside a fused
    op), cannot follow: ExportFailure naming it."""
    chain = variant_chain(variant)
    if chain.chooser:
        raise UsageError(f"variant {variant} chooses among the others instead of making a graph")
    first, *rest = chain.links
    graph = _make(first, source, provider, positions)
    if not rest:
        # a re-export at another opset is not the plain export, even where the link keeps it
        plain = first.maker is not None and first.export_opset is None
        if plain and _signature(graph.proto) == _signature(source):
            said = f"{first.name} left the graph as it was (ops, attributes, types): it computes as the plain export"
            graph.info["unchanged"] = said
            graph.warnings.append(said)
        return graph
    links = [{"variant": first.name, "info": graph.info}]
    warnings = [f"{first.name}: {w}" for w in graph.warnings]
    metadata = dict(graph.metadata)
    for before, link in zip(chain.links, rest, strict=False):
        cannot = f"{link.name} cannot follow {before.name}"
        try:
            made = _make(link, graph.proto, provider, positions)
        except AttnExportError as e:
            raise ExportFailure(f"{cannot}: {e}") from e
        except Exception as e:  # noqa: BLE001 - a link's tool meets a graph it was not written for
            raise ExportFailure(f"{cannot}: {link.name} failed on its graph: {first_line(e)}") from e
        if _signature(made.proto) == _signature(graph.proto):
            raise ExportFailure(f"{cannot}: it leaves {before.name}'s graph as it was (ops, attributes, types)")
        links.append({"variant": link.name, "info": made.info})
        warnings += [f"{link.name}: {w}" for w in made.warnings]
        metadata |= made.metadata
        graph = made
    return VariantGraph(graph.proto, {"links": links}, warnings, metadata)
