"""Modules that draw random numbers in eval mode, or keep state between calls, or that only
look as if they might."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_export.zoo.seed import MultiHeadAttention


class DropoutAlwaysAttention(MultiHeadAttention):
    """SDPA called with ``dropout_p`` whatever the mode, as common code does."""

    dropout_p = 0.1

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, s, _ = query.shape
        q = self.q_linear(query).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_linear(keys).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_linear(values).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        out = self.noise(F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p))
        return self.out_linear(out.transpose(1, 2).reshape(b, s, self.hidden_dim))

    def noise(self, out: torch.Tensor) -> torch.Tensor:
        return out


class TinyDropoutAttention(DropoutAlwaysAttention):
    """A drop so rare that two runs of the module agree most of the time."""

    dropout_p = 1e-6


class DropoutTrainingAttention(DropoutAlwaysAttention):
    dropout_p = 0.0

    def noise(self, out: torch.Tensor) -> torch.Tensor:
        return F.dropout(out, 0.1, training=True)


class NoisyAttention(DropoutAlwaysAttention):
    dropout_p = 0.0

    def noise(self, out: torch.Tensor) -> torch.Tensor:
        return out + 1e-3 * torch.randn_like(out)


class NoDropoutAttention(DropoutAlwaysAttention):
    """``dropout_p`` 0 and dropout outside training: deterministic, as the exported graph is."""

    dropout_p = 0.0

    def noise(self, out: torch.Tensor) -> torch.Tensor:
        return F.dropout(out, 0.5, training=self.training)


class CountingAttention(DropoutAlwaysAttention):
    """Counts its calls in a buffer and drifts with the count, by less than two runs of the
    module can tell from rounding."""

    dropout_p = 0.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(query, keys, values) * (1 + 1e-7 * self.calls)


class KeptStateAttention(CountingAttention):
    """Keeps the last call's first value in a slice of a buffer, as a cache kept inside a module does."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("last", torch.zeros(2))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = DropoutAlwaysAttention.forward(self, query, keys, values)
        before = out + 1e-7 * self.last[0]
        self.last[0] = out[0, 0, 0]
        return before


class AttributeStateAttention(DropoutAlwaysAttention):
    """Keeps the last call's first value in a plain tensor attribute (not a buffer)."""

    dropout_p = 0.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.last = torch.zeros(2)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().forward(query, keys, values)
        before = out + 1e-7 * self.last[1]
        self.last[1] = out[0, 0, 0]
        return before


class ReassignedStateAttention(AttributeStateAttention):
    """Counts its calls by assigning a new tensor to an attribute each call."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.last = self.last + 1
        return DropoutAlwaysAttention.forward(self, query, keys, values) * (1 + 1e-7 * self.last[0])


class KeptWeightsAttention(AttributeStateAttention):
    """Keeps its last output for inspection, as many modules keep attention weights: it is
    never read back, so no call depends on another."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.last = DropoutAlwaysAttention.forward(self, query, keys, values)
        return self.last


class OverwrittenStateAttention(DropoutAlwaysAttention):
    """Picks a gain by its query's largest value and writes it whole into a buffer before
    reading it, as transformers' longrope picks its frequencies: no call reads what an
    earlier one left."""

    dropout_p = 0.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register_buffer("gain", torch.ones(()))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.gain.copy_(torch.where(query.abs().max() > 1, torch.tensor(2.0), torch.tensor(0.5)))
        return super().forward(query, keys, values) * self.gain


class ReadThenOverwrittenAttention(OverwrittenStateAttention):
    """Reads its gain, then writes it whole: each call scales by what the call before left."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = DropoutAlwaysAttention.forward(self, query, keys, values) * self.gain
        self.gain.copy_(torch.where(query.abs().max() > 1, torch.tensor(4.0), torch.tensor(0.25)))
        return out


class AliasReadAttention(OverwrittenStateAttention):
    """Reads its gain through a plain attribute holding the buffer, then writes the buffer
    whole: each call scales by what the call before left, though the buffer's own node is
    read by nothing before its write."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.alias = self.gain

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = DropoutAlwaysAttention.forward(self, query, keys, values) * self.alias
        self.gain.copy_(torch.where(query.abs().max() > 1, torch.tensor(3.0), torch.tensor(0.75)))
        return out


class InPlaceInputAttention(DropoutAlwaysAttention):
    """Scales its query in place: deterministic, as long as each run gets its own copy."""

    dropout_p = 0.0

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        query.mul_(2)
        return super().forward(query, keys, values)


class MaskedDropoutAttention(torch.nn.Module):
    """SDPA with a padding mask and ``dropout_p`` whatever the mode: build probes the mask
    (with the module) before it exports."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], dropout_p=0.1)
        return y.transpose(1, 2).reshape(b, s, h)
