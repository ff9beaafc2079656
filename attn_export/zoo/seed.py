"""The seed tutorial's modules, kept faithful: same math, same parameters, same outputs.

Every other module in the zoo is tested numerically against these two.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MultiHeadAttention", "ScaledDotProductAttention"]


class ScaledDotProductAttention(nn.Module):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d_k)) V.

    Returns ``(output, attn_weights)``. A mask marks positions to keep with a non-zero
    value; the others are filled with -1e9 before the softmax, so a fully masked row
    yields uniform weights rather than NaN.
    """

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [..., seq, d_k], k: [..., kv_seq, d_k], v: [..., kv_seq, d_v]."""
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn_weights = F.softmax(scores, dim=-1)
        attn_weights = self.dropout(attn_weights)
        output = torch.matmul(attn_weights, v)
        return output, attn_weights


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate query/key/value projections and an output projection.

    ``query`` is [batch, seq, hidden]; ``keys`` and ``values`` are [batch, kv_seq, hidden],
    and kv_seq may differ from seq (cross-attention).
    """

    def __init__(self, hidden_dim: int, num_heads: int) -> None:
        super().__init__()
        assert hidden_dim % num_heads == 0
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads

        self.q_linear = nn.Linear(hidden_dim, hidden_dim)
        self.k_linear = nn.Linear(hidden_dim, hidden_dim)
        self.v_linear = nn.Linear(hidden_dim, hidden_dim)
        self.out_linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch_size = query.size(0)

        q = self.q_linear(query)
        k = self.k_linear(keys)
        v = self.v_linear(values)

        q = q.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)

        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
        attention_weights = F.softmax(scores, dim=-1)
        output = torch.matmul(attention_weights, v)

        output = output.transpose(1, 2).contiguous().view(batch_size, -1, self.hidden_dim)
        output = self.out_linear(output)
        return output
