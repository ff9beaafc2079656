"""The graph-variant table: the one list that spec validation, build keys, ``auto``, the
CLI's choices and the manifest read.

A variant is made by ``attn_export.exporter.variants.<maker>.make``; adding one is a new
file there plus one row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_export.spec.tolerance import Tolerance

__all__ = ["AUTO", "VARIANTS", "VariantInfo", "auto_candidates", "variant_key"]


@dataclass(frozen=True)
class VariantInfo:
    """What every consumer needs to know about one graph variant."""

    name: str
    summary: str
    #: Module under ``attn_export.exporter.variants`` whose ``make`` derives it; None for the plain export.
    maker: str | None = None
    #: Default tolerance when the spec gives none; None means the model's own.
    tolerance: Tolerance | None = None
    #: Derived from a re-export at this opset instead of from the plain graph.
    export_opset: int | None = None
    #: The graph depends on ``--provider`` (part of the build key).
    provider_dependent: bool = False
    #: ``auto`` times it as a candidate.
    auto_candidate: bool = True
    #: ``auto`` tries it only when the target provider is CUDA.
    cuda_only: bool = False
    #: Chooses among the other variants instead of making a graph (``auto``).
    chooser: bool = False


AUTO = "auto"

VARIANTS: dict[str, VariantInfo] = {
    v.name: v
    for v in (
        VariantInfo("fp32", "the plain export"),
        VariantInfo(
            "attention-op", "re-exported at opset 23 with the ONNX Attention op", "attention_op", export_opset=23
        ),
        VariantInfo("ort-fused", "onnxscript's optimize_for_ort fusions", "ort_fused"),
        VariantInfo(
            "ort-past",
            "a decoder's cache attention as ONNX Runtime's MultiHeadAttention or GroupQueryAttention with past inputs",
            "ort_past",
            export_opset=23,
        ),
        VariantInfo(
            "static-cache",
            "a decoder's cache as a fixed-capacity buffer written in place (GroupQueryAttention up to a length)",
            "static_cache",
            export_opset=23,
            auto_candidate=False,
        ),
        VariantInfo("int8", "dynamic int8 quantization of MatMuls", "int8", tolerance=Tolerance(0.1, 0.1)),
        VariantInfo(
            "fp16",
            "float16 inside, float32 inputs and outputs",
            "fp16",
            tolerance=Tolerance(1e-2, 1e-2),
            cuda_only=True,
        ),
        VariantInfo(
            "ort-optimized", "the graph ONNX Runtime optimizes for --provider", "ort_optimized", provider_dependent=True
        ),
        VariantInfo(
            AUTO,
            "the fastest candidate within the model's own tolerance",
            provider_dependent=True,
            auto_candidate=False,
            chooser=True,
        ),
    )
}


def auto_candidates(provider: str) -> list[str]:
    """The variants ``auto`` times on ``provider``, in table order."""
    return [v.name for v in VARIANTS.values() if v.auto_candidate and (provider == "cuda" or not v.cuda_only)]


def variant_key(model: str, variant: str) -> str:
    """Manifest key and file stem: the plain graph keeps the model's name."""
    return model if variant == "fp32" else f"{model}.{variant}"
