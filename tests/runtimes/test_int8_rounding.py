"""The int8 rounding simulated in PyTorch rounds what ``quantize_dynamic`` quantizes, and
nothing else: a MatMul whose second operand is a whole weight of the module."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from attn_export.runtimes.int8_rounding import in_int8


class _Uses(nn.Module):
    """One weight, used whole, as a chunk, or on another constant of the module."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.randn(24, 8))
        self.latents = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "whole":
            return F.linear(x, self.weight)
        if self.how == "transposed":
            return x @ self.weight.t()
        if self.how == "cut whole":  # a table cut to a length that is all of it: the graph keeps the Slice
            return F.linear(x, self.weight[: x.shape[1] * 5])
        if self.how == "chunk":  # a packed projection cut in three: the graph keeps the Split
            return torch.cat([F.linear(x, w) for w in self.weight.chunk(3)], dim=-1)
        # learned queries: both operands constant, folded into one constant by the export
        return x[..., :4] + F.linear(self.latents, self.weight).sum()


def _changed(how: str) -> bool:
    torch.manual_seed(0)
    module = _Uses(how).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        return not torch.equal(module(x), in_int8(module, x))


def test_only_a_whole_weight_as_the_second_operand_is_rounded() -> None:
    assert _changed("whole") and _changed("transposed")
    assert not _changed("chunk") and not _changed("cut whole") and not _changed("first")
