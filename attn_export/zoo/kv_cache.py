"""Decoder steps with a key/value cache, as deployed for autoregressive decoding.

Each forward takes positional tensors and returns ``(output, present_key, present_value)``:

* ``attention_mask`` is ``[batch, past_seq + seq]`` int64, 1 = attend, 0 = padding (left
  padding allowed);
* the causal mask is aligned to the end of the keys: query ``i`` of this step sees keys
  ``j <= past_seq + i`` (``is_causal=True`` would align it top-left when past_seq > 0);
* ``present = cat(past, new)`` along dim 2, the layout ``[batch, kv_heads, past_seq + seq,
  head_dim]`` that Optimum and onnxruntime-genai use;
* attention goes through ``F.scaled_dot_product_attention`` with the mask as an additive
  bias (grouped heads through ``enable_gqa``), so the opset-23 export holds the ONNX
  ``Attention`` op and its variants can take the cache into the op;
* a query that sees no key (a left-padded position) gives 0 in PyTorch and in the exported
  graph alike: scores get a finite minimum (never -inf) and the output is multiplied by a
  has-any-key indicator;
* ``window=N`` makes the cache a sliding window: each present keeps the newest
  ``min(past_seq + seq, N)`` positions (``narrow`` by a ``torch.sym_min``, which exports as
  ``Min(N, total_seq)``), and a query sees itself and the N positions before it, with or
  without a cache. Its spec declares ``[cache] window = N`` (``model_spec.cache``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn_export.zoo.seed import MultiHeadAttention

__all__ = ["GQARopeKVCache", "MHAKVCache"]


class _CachedAttention(nn.Module):
    """Mask, attention and cache logic shared by the decoder steps below."""

    head_dim: int
    #: The positions a present keeps, and how many before itself a query sees; None: all.
    window: int | None = None

    def causal_mask(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        """``[q_len, k_len]`` bool, True where query i may see key j (aligned to the end;
        with a window, no further back than ``window`` positions)."""
        q_pos = (torch.arange(q_len, device=device) + (k_len - q_len))[:, None]
        k_pos = torch.arange(k_len, device=device)[None, :]
        allowed = k_pos <= q_pos
        return allowed if self.window is None else allowed & (k_pos >= q_pos - self.window)

    def present(self, full: Tensor) -> Tensor:
        """The cache handed back: past and new positions, the newest ``window`` of them."""
        if self.window is None:
            return full
        length = full.shape[2]
        kept = torch.sym_min(length, self.window)
        return full.narrow(2, length - kept, kept)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Attention ``[b, seq, heads * d]`` and a has-any-key indicator ``[b, seq, 1]``."""
        allowed = self.causal_mask(q.shape[2], k.shape[2], q.device)[None, None] & (
            attention_mask[:, None, None, :] != 0
        )
        lowest = torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
        bias = torch.where(allowed, torch.zeros_like(lowest), lowest)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=k.shape[1] != q.shape[1])
        has_key = allowed[:, 0].any(dim=-1, keepdim=True).to(q.dtype)
        return out.transpose(1, 2).flatten(2), has_key


class MHAKVCache(MultiHeadAttention, _CachedAttention):
    """The seed MultiHeadAttention as a causal self-attention step with a cache
    ``[batch, heads, past_seq, head_dim]`` (same projections, same weights layout)."""

    def __init__(self, hidden_dim: int, num_heads: int, window: int | None = None) -> None:
        super().__init__(hidden_dim, num_heads)
        self.window = window

    def forward(  # type: ignore[override]
        self, hidden_states: Tensor, attention_mask: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = hidden_states.shape

        def heads(x: Tensor) -> Tensor:
            return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        q = heads(self.q_linear(hidden_states))
        key = torch.cat((past_key, heads(self.k_linear(hidden_states))), dim=2)
        value = torch.cat((past_value, heads(self.v_linear(hidden_states))), dim=2)
        out, has_key = self.attend(q, key, value, attention_mask)
        return self.out_linear(out) * has_key, self.present(key), self.present(value)


class GQARopeKVCache(_CachedAttention):
    """LLaMA-style step: q/k/v/o projections without bias, grouped-query attention, rotary
    embeddings at ``position_ids``; the cache ``[batch, kv_heads, past_seq, head_dim]``
    holds keys after rotary."""

    inv_freq: Tensor

    def __init__(
        self,
        hidden: int = 64,
        num_heads: int = 8,
        num_kv_heads: int = 2,
        rope_theta: float = 10000.0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", 1.0 / rope_theta**exponents, persistent=False)

    def positions(self, position_ids: Tensor) -> Tensor:
        """Rotary positions ``[b, seq]`` of this step's tokens."""
        return position_ids

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotary embedding (rotate-half form) of ``x`` ``[b, heads, seq, d]`` at ``positions``."""
        freqs = positions[:, None, :, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor, position_ids: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        positions = self.positions(position_ids)
        q, k = self.rotate(q, positions), self.rotate(k, positions)
        key, value = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
        out, has_key = self.attend(q, key, value, attention_mask)
        return self.o_proj(out) * has_key, self.present(key), self.present(value)
