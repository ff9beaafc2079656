"""The zoo's PyTorch modules: the seed tutorial's forms and masked/SDPA forms of them."""

from __future__ import annotations

from attn_export.zoo.masked import MaskedMultiHeadAttention, SDPAMultiHeadAttention
from attn_export.zoo.seed import MultiHeadAttention, ScaledDotProductAttention

__all__ = [
    "MaskedMultiHeadAttention",
    "MultiHeadAttention",
    "SDPAMultiHeadAttention",
    "ScaledDotProductAttention",
]
