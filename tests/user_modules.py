"""Modules a user might bring: written as users write them, not as the zoo does."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaStyleAttention(nn.Module):
    """Grouped-query attention with rotary positions and causal SDPA, LLaMA style."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2, base: float = 10000.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class ConventionAttention(nn.Module):
    """Single-head attention reading its mask in one convention (``attend``, ``ignore``,
    ``additive``, ``additive-min``, ``binary``); ``flipped`` reads it the other way round, a
    fault its spec cannot show."""

    def __init__(self, hidden: int = 8, convention: str = "attend", flipped: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.convention, self.flipped = convention, flipped

    def _bias(self, mask: torch.Tensor) -> torch.Tensor:
        """The mask as SDPA reads it: a bool keep-mask or an additive float bias."""
        if self.convention in ("attend", "ignore", "binary"):
            keep = mask != 0 if self.convention == "binary" else mask
            keep = ~keep if self.convention == "ignore" else keep
            return ~keep if self.flipped else keep
        if not self.flipped:
            return mask
        return torch.where(mask == 0, torch.finfo(mask.dtype).min, torch.zeros((), dtype=mask.dtype))

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = self._bias(mask)
        bias = bias[:, None, None, :] if bias.dim() == 2 else bias[:, None]  # [batch, 1 head, seq or 1, kv_seq]
        q, k, v = (p(t)[:, None] for p, t in ((self.q_proj, x), (self.k_proj, kv), (self.v_proj, kv)))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)[:, 0]


def make_mha(embed_dim: int, num_heads: int, batch_first: bool) -> nn.MultiheadAttention:
    """A factory function, as a spec's module may name instead of a class."""
    return nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first)


class TokenAttention(nn.Module):
    """Token ids and token types through their own embeddings (a view of the ids, as
    Hugging Face reshapes them), then self-attention."""

    def __init__(self, vocab: int = 50, types: int = 2, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, hidden)
        self.types = nn.Embedding(types, hidden)
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.words(input_ids.view(-1, input_ids.shape[-1])) + self.types(token_type_ids)
        return self.attention(x, x, x, need_weights=False)[0]


class WeightProducts(nn.Module):
    """A Linear, a matmul by a transposed parameter (``.T``), GPT-2's ``Conv1D`` (``addmm`` of a
    parameter), and two products int4 leaves alone: two computed tensors, and an ``addmm``
    scaled by ``alpha``."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.conv_weight = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.conv_bias = nn.Parameter(torch.randn(hidden) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.proj(x)
        b = a @ self.weight.T
        flat = b.reshape(-1, b.shape[-1])
        c = torch.addmm(self.conv_bias, flat, self.conv_weight).view(b.shape)
        scaled = torch.addmm(self.conv_bias, flat, self.conv_weight, alpha=0.5).view(b.shape)
        return (c @ scaled.transpose(-1, -2)) @ a
