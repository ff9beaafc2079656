"""Reference PyTorch attention modules: the seed tutorial's forms and their variants."""

from __future__ import annotations

from attn_export.reference.seed import MultiHeadAttention, ScaledDotProductAttention
from attn_export.reference.variants import MaskedMultiHeadAttention, SDPAMultiHeadAttention

__all__ = [
    "MaskedMultiHeadAttention",
    "MultiHeadAttention",
    "SDPAMultiHeadAttention",
    "ScaledDotProductAttention",
]
