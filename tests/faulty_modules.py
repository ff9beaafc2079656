"""Modules with planted export faults; each exports cleanly but is wrong off the example shape."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attn_export.zoo.seed import MultiHeadAttention


class BakedBatchAttention(MultiHeadAttention):
    """Seed MHA whose reshape uses Python ints: tracing bakes the example's batch and length."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, s = int(query.shape[0]), int(query.shape[1])
        q = self.q_linear(query).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_linear(keys).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_linear(values).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        w = F.softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, dim=-1)
        return self.out_linear((w @ v).transpose(1, 2).reshape(b, s, self.hidden_dim))


class ShapeBranchAttention(MultiHeadAttention):
    """Seed MHA with a Python branch on the query length: tracing freezes the example's branch."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().forward(query, keys, values)
        if query.shape[1] == 1:  # single-token decode path: skip attention entirely
            return self.out_linear(self.v_linear(values).mean(dim=1, keepdim=True))
        return out


class SevenAttention(MultiHeadAttention):
    """Seed MHA whose Python halves its output at exactly seven query positions (and at a
    batch of three, and at 1280..1343 positions): torch.export guards seq != 7, batch != 3
    and seq // 64 != 20, and a graph built past them agrees with PyTorch at every corner."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().forward(query, keys, values)
        if query.shape[1] == 7:
            out = out * 0.5
        if query.shape[0] == 3:
            out = out * 0.5
        if query.shape[1] // 64 == 20:
            out = out * 0.5
        return out


class LongSequenceBranchAttention(MultiHeadAttention):
    """Seed MHA that halves its output past 64 query positions: the trace keeps one branch."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().forward(query, keys, values)
        if query.shape[1] > 64:
            out = out * 0.5
        return out


class ValueBranchAttention(MultiHeadAttention):
    """Seed MHA that rescales large inputs: a branch on the values, which no graph can hold."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if query.abs().max() > 50:
            query = query / 10
        return super().forward(query, keys, values)


class LogScaleAttention(MultiHeadAttention):
    """Seed MHA scaled by the log of its length, computed as a Python number: the trace
    fixes the length to the example's."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return super().forward(query, keys, values) * math.log(query.shape[1] + 1)


class TwoFixedDimsAttention(LogScaleAttention):
    """LogScaleAttention that also branches on the keys' length: two dims fixed, each at
    its own line."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if keys.shape[1] == 5:
            keys = keys * 1.0
        return super().forward(query, keys, values)


class NoFloat16Attention(MultiHeadAttention):
    """Seed MHA that has no float16 kernel: the fp16 variant's simulated rounding cannot run
    (``runtimes.int8_rounding.in_float16``), and its graph is judged by the shares of the rms alone."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if query.dtype == torch.float16:
            raise RuntimeError("no float16 kernel")
        return super().forward(query, keys, values)
