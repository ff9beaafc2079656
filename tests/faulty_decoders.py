"""Decoder steps with one planted cache bug each, for the decode tests: each subclass of a
zoo module overrides one small method."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attn_export.zoo.kv_cache import GQARopeKVCache, MHAKVCache


def _top_left(q_len: int, k_len: int, device: torch.device) -> Tensor:
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None]


class TopLeftCausal(MHAKVCache):
    """The causal mask aligned top-left (j <= i), as ``is_causal=True`` aligns it: right
    while the cache is empty, wrong once it holds something."""

    def causal_mask(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        return _top_left(q_len, k_len, device)


class RotaryNotOffset(GQARopeKVCache):
    """Rotary positions ``arange(seq)``: every step's new token is rotated as position 0."""

    def positions(self, position_ids: Tensor) -> Tensor:
        return torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)


class PresentDropsNewToken(MHAKVCache):
    """The present is the past alone: the new token never reaches the cache."""

    def present(self, full: Tensor) -> Tensor:
        return full[:, :, :-1]


class PresentWithoutNewToken(MHAKVCache):
    """The present has the right shape, but zeros where the new tokens' keys belong."""

    def forward(  # type: ignore[override]
        self, hidden_states: Tensor, attention_mask: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, key, value = super().forward(hidden_states, attention_mask, past_key, past_value)
        new = torch.arange(key.shape[2], device=key.device) >= past_key.shape[2]
        return out, key.masked_fill(new[:, None], 0.0), value


class PresentGrowsExtraRow(MHAKVCache):
    """Each present holds its first position twice: every output is right, but the cache
    grows by one row more than the step's tokens."""

    def present(self, full: Tensor) -> Tensor:
        return torch.cat((full[:, :, :1], full), dim=2)


class WindowNeverTrims(MHAKVCache):
    """A sliding window (``window=N``) that masks the keys beyond it but never drops them:
    every output is right while the present grows by every token."""

    def present(self, full: Tensor) -> Tensor:
        return full


class PastBaked(GQARopeKVCache):
    """A reshape sized by a Python int taken from the example's cache length."""

    def present(self, full: Tensor) -> Tensor:
        b, heads, _, d = full.shape
        t = int(full.shape[2])
        return full.reshape(b, heads, t, d)


class PromptIgnoresPadding(MHAKVCache):
    """A prompt path (empty cache) that reads no padding: torch.export decides ``== 0`` on a
    size as False at the example and keeps the general path, without a guard."""

    def forward(  # type: ignore[override]
        self, hidden_states: Tensor, attention_mask: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        if past_key.shape[2] == 0:
            attention_mask = torch.ones_like(attention_mask)
        return super().forward(hidden_states, attention_mask, past_key, past_value)


class SafeSoftmaxOnly(MHAKVCache):
    """Attention through SDPA with a boolean mask and no has-any-key factor: PyTorch's safe
    softmax gives 0 for a query that sees no key, the exported graph NaN."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        allowed = self.causal_mask(q.shape[2], k.shape[2], q.device)[None, None] & (
            attention_mask[:, None, None, :] != 0
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return out.transpose(1, 2).flatten(2), torch.ones_like(q[:, 0, :, :1])


class IgnoresMask(MHAKVCache):
    """attention_mask read as all ones: padding is attended."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        return super().attend(q, k, v, torch.ones_like(attention_mask))


class FirstRowMask(MHAKVCache):
    """Every row reads the first row's mask: right at batch 1 only."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        return super().attend(q, k, v, attention_mask[:1].expand_as(attention_mask))


class WithoutMask(MHAKVCache):
    """The zoo decoder for a spec without ``attention_mask``: every token is real."""

    def forward(  # type: ignore[override]
        self, hidden_states: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = hidden_states.shape
        ones = torch.ones(b, past_key.shape[2] + s, dtype=torch.int64, device=hidden_states.device)
        return super().forward(hidden_states, ones, past_key, past_value)


class NoCausalMask(WithoutMask):
    """Every query sees every key: the prompt's tokens see the ones after them."""

    def causal_mask(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device)


class KeyCountScale(WithoutMask):
    """Scores scaled by 1/sqrt(number of keys) instead of 1/sqrt(head_dim)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        allowed = self.causal_mask(q.shape[2], k.shape[2], q.device)[None, None]
        keys = torch.ones_like(k[..., :1]).sum(dim=2, keepdim=True)  # the key count as a tensor: no baked int
        scores = (q @ k.transpose(-2, -1)) * keys.rsqrt().transpose(-2, -1)
        weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(q.dtype).min), dim=-1)
        return (weights @ v).transpose(1, 2).flatten(2), torch.ones_like(q[:, 0, :, :1])
