"""The variants equal the seed modules wherever their features overlap."""

from __future__ import annotations

import math

import pytest
import torch

from attn_export.zoo import (
    MaskedMultiHeadAttention,
    MultiHeadAttention,
    ScaledDotProductAttention,
    SDPAMultiHeadAttention,
)

torch.manual_seed(0)
HIDDEN, HEADS = 32, 4


def _pair(cls: type) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    seed = MultiHeadAttention(HIDDEN, HEADS).eval()
    other = cls(HIDDEN, HEADS).eval()
    other.load_state_dict(seed.state_dict())
    return seed, other


def _qkv(batch: int = 2, seq: int = 5, kv: int = 7) -> tuple[torch.Tensor, ...]:
    return torch.randn(batch, seq, HIDDEN), torch.randn(batch, kv, HIDDEN), torch.randn(batch, kv, HIDDEN)


@pytest.mark.parametrize("cls", [MaskedMultiHeadAttention, SDPAMultiHeadAttention])
def test_variant_without_mask_equals_seed(cls: type) -> None:
    seed, variant = _pair(cls)
    q, k, v = _qkv()
    torch.testing.assert_close(variant(q, k, v), seed(q, k, v), atol=1e-6, rtol=1e-5)


def test_sdpa_variant_with_mask_equals_masked_variant() -> None:
    _, masked = _pair(MaskedMultiHeadAttention)
    sdpa = SDPAMultiHeadAttention(HIDDEN, HEADS).eval()
    sdpa.load_state_dict(masked.state_dict())
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 5, 7) < 0.7
    mask[..., 0] = True  # no fully masked row: there the two differ by design (-1e9 vs -inf)
    torch.testing.assert_close(sdpa(q, k, v, mask), masked(q, k, v, mask), atol=1e-6, rtol=1e-5)


def test_causal_equals_seed_sdpa_with_causal_mask() -> None:
    _, causal = _pair(MaskedMultiHeadAttention)
    causal.causal = True
    q, k, v = _qkv(seq=6, kv=6)
    tril = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    heads = [
        lin(x).view(2, -1, HEADS, HIDDEN // HEADS).transpose(1, 2)
        for lin, x in ((causal.q_linear, q), (causal.k_linear, k), (causal.v_linear, v))
    ]
    out, _ = ScaledDotProductAttention(0.0)(*heads, mask=tril)
    expected = causal.out_linear(out.transpose(1, 2).reshape(2, -1, HIDDEN))
    torch.testing.assert_close(causal(q, k, v), expected, atol=1e-6, rtol=1e-5)


def test_seed_sdpa_returns_output_and_weights_and_masks_with_minus_1e9() -> None:
    sdpa = ScaledDotProductAttention().eval()
    q, k, v = torch.randn(1, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    mask = torch.ones(1, 3, 4, dtype=torch.bool)
    mask[0, 1] = False  # fully masked row
    out, weights = sdpa(q, k, v, mask)
    assert out.shape == (1, 3, 8) and weights.shape == (1, 3, 4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(weights[0, 1], torch.full((4,), 0.25))
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    torch.testing.assert_close(weights[0, 0], torch.softmax(scores[0, 0], -1))


def test_seed_sdpa_dropout_is_active_only_in_train_mode() -> None:
    sdpa = ScaledDotProductAttention(dropout=0.5)
    q = torch.randn(1, 16, 8)
    sdpa.train()
    _, w_train = sdpa(q, q, q)
    sdpa.eval()
    _, w_eval = sdpa(q, q, q)
    assert (w_train == 0).any() and not (w_eval == 0).any()
