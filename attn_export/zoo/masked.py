"""Masked and SDPA forms of the seed multi-head attention: the same parameters, more features.

Both subclass the seed ``MultiHeadAttention`` so a state_dict moves freely between them,
and both equal the seed where their features are off (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_export.zoo.seed import MultiHeadAttention

__all__ = ["MaskedMultiHeadAttention", "SDPAMultiHeadAttention"]


def _split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    return x.view(x.size(0), -1, num_heads, head_dim).transpose(1, 2)


def _merge_heads(x: torch.Tensor, hidden_dim: int) -> torch.Tensor:
    return x.transpose(1, 2).contiguous().view(x.size(0), -1, hidden_dim)


def _keep_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """Combine a user mask (True = attend) with a top-left-aligned causal mask."""
    if causal:
        ones = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device)
        causal_mask = torch.tril(ones)
        mask = causal_mask if mask is None else (mask != 0) & causal_mask
    return mask


class MaskedMultiHeadAttention(MultiHeadAttention):
    """Seed multi-head attention plus an optional boolean mask and a causal flag.

    ``mask`` broadcasts to [batch, heads, seq, kv_seq] and is True where a query may attend.
    Masked scores are filled with -1e9 as in the seed, so fully masked rows stay finite.
    """

    def __init__(self, hidden_dim: int, num_heads: int, causal: bool = False) -> None:
        super().__init__(hidden_dim, num_heads)
        self.causal = causal

    def _project_heads(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split into [batch, heads, len, head_dim], as the seed does."""
        return (
            _split_heads(self.q_linear(query), self.num_heads, self.head_dim),
            _split_heads(self.k_linear(keys), self.num_heads, self.head_dim),
            _split_heads(self.v_linear(values), self.num_heads, self.head_dim),
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = self._project_heads(query, keys, values)

        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
        keep = _keep_mask(q, k, mask, self.causal)
        if keep is not None:
            scores = scores.masked_fill(keep == 0, -1e9)
        attention_weights = F.softmax(scores, dim=-1)
        output = torch.matmul(attention_weights, v)
        return self.out_linear(_merge_heads(output, self.hidden_dim))


class SDPAMultiHeadAttention(MaskedMultiHeadAttention):
    """Multi-head attention computed by ``F.scaled_dot_product_attention``.

    Exported at opset 23 this becomes the ONNX ``Attention`` op. A boolean mask follows
    PyTorch's convention (True = attend); unlike the seed, a fully masked row has no
    finite softmax, which is exactly what verification must surface.
    """

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = self._project_heads(query, keys, values)

        keep = _keep_mask(q, k, mask, self.causal)
        if keep is not None:
            keep = keep.to(torch.bool)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out_linear(_merge_heads(output, self.hidden_dim))
