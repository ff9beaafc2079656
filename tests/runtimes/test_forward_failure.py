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
