"""A module that fails in PyTorch on the drawn inputs says on which: their shapes and the
values each integer input held, and what to declare where an id past a table is the cause."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_export.errors import RuntimeFailure
from attn_export.model_spec import TensorSpec
from attn_export.runtimes.torch_eager import TorchRuntime


class ShiftedPositions(torch.nn.Module):
    """Reads its 10-row position table at ``pos + seq``: it takes fewer positions than the
    spec lets verify draw."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = torch.nn.Embedding(10, 8)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.wpe(pos + x.shape[1])


def test_a_failed_forward_names_the_inputs_and_the_ids_it_was_given() -> None:
    inputs = [TensorSpec("x", "float32", ("batch", "seq", 8)), TensorSpec("pos", "int64", ("batch", "seq"))]
    feeds = {"x": np.zeros((1, 5, 8), np.float32), "pos": np.array([[0, 1, 2, 3, 6]])}
    outputs = [TensorSpec("y", "float32", ("batch", "seq", 8))]
    with TorchRuntime(ShiftedPositions().eval(), inputs, outputs) as eager, pytest.raises(RuntimeFailure) as failed:
        eager.run(feeds)
    assert str(failed.value) == (
        "torch[cpu]: forward failed on x [1, 5, 8] float32, pos [1, 5] int64 in 0..6: IndexError: index out of "
        "range in self; where an integer input takes fewer values than drawn, declare values = { min, max } on it"
    )


class PaddedEncoder(torch.nn.Module):
    """A stock ``nn.TransformerEncoder`` as PyTorch builds it by default (nested tensors on)."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=pad)


def test_nested_tensors_failing_on_a_fully_padded_sequence_say_how_to_turn_them_off() -> None:
    """PyTorch's words alone ("to_padded_tensor: at least one constituent tensor ...") left
    the user to find that the encoder's fast path, on by default, is the cause."""
    inputs = [TensorSpec("x", "float32", ("batch", "seq", 16)), TensorSpec("pad", "bool", ("batch", "seq"))]
    feeds = {"x": np.ones((2, 3, 16), np.float32), "pad": np.ones((2, 3), bool)}
    outputs = [TensorSpec("y", "float32", ("batch", "seq", 16))]
    with TorchRuntime(PaddedEncoder().eval(), inputs, outputs) as eager, pytest.raises(RuntimeFailure) as failed:
        eager.run(feeds)
    assert str(failed.value).endswith(
        "; PyTorch's fast path packed the batch as nested tensors, which fails where a padding mask hides every "
        "sequence (the mask probe draws such a batch): build nn.TransformerEncoder with "
        "enable_nested_tensor=False; the exported graph takes the padded batch either way"
    ), failed.value
