"""PyTorch is the reference only where it agrees with itself: a module that is random in
eval mode fails naming the cause (its randomness never becomes tolerance), and the float32
floor is PyTorch's own error at the run's threads or at one thread, whichever is larger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attn_export.errors import NondeterministicModule
from attn_export.model_spec import TensorSpec
from attn_export.runtimes.float64 import in_float64
from attn_export.runtimes.torch_eager import TorchRuntime
from tests.conftest import build_tiny_with
from tests.random_modules import DropoutAlwaysAttention

X = TensorSpec("x", "float32", ("batch", "seq", 32))
Y = TensorSpec("y", "float32", ("batch", "seq", 32))


class ThreadSensitive(torch.nn.Module):
    """Rounds differently on one thread: its float32 error there is 1e-3, elsewhere 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and torch.get_num_threads() == 1:
            return x + 1e-3
        return x


def test_a_module_random_in_eval_fails_the_torchscript_build_naming_pytorch(tmp_path: Path) -> None:
    """The torchscript exporter keeps no FX program: two runs of the module judge it."""
    result = build_tiny_with(tmp_path, DropoutAlwaysAttention, exporter="torchscript")
    assert result.exit_code == 1, result.output
    assert "[golden] PyTorch is not deterministic in eval mode: two runs of the module on one input differ by" in (
        result.output
    )
    assert "dropout_p" in result.output
    assert not (tmp_path / "out" / "tiny.onnx").exists()


def test_precision_floor_refuses_a_second_answer_before_measuring_anything() -> None:
    torch.manual_seed(0)
    module = DropoutAlwaysAttention(32, 4)
    spec_in = [TensorSpec(n, "float32", ("batch", "seq", 32)) for n in ("q", "k", "v")]
    feeds = {t.name: np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32) for t in spec_in}
    with TorchRuntime(module, spec_in, [Y]) as eager:
        outputs = eager.run(feeds)
        with pytest.raises(NondeterministicModule, match="output 'y'"):
            eager.precision_floor(feeds, outputs)


@pytest.mark.parametrize("threads", [2, 4])
def test_the_floor_is_the_larger_of_the_runs_threads_and_one_thread(threads: int) -> None:
    feeds = {"x": np.ones((1, 3, 32), dtype=np.float32)}
    with TorchRuntime(ThreadSensitive(), [X], [Y], threads=threads) as eager:
        floor = eager.precision_floor(feeds, eager.run(feeds))["y"]
    assert floor == pytest.approx(1e-3, rel=1e-3)
    with TorchRuntime(ThreadSensitive(), [X], [Y], threads=1) as eager:
        assert eager.precision_floor(feeds, eager.run(feeds))["y"] == pytest.approx(1e-3, rel=1e-3)


class NamesFloat32(torch.nn.Module):
    """Projects through a table its code builds in float32, as rotary and projection code
    often does: cast to double as a whole, it fails at the matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.eye(32, dtype=torch.float32) / 3
        return torch.softmax(self.linear(x) @ table, dim=-1).float() * 1e3


def test_the_floor_is_measured_where_the_code_names_float32() -> None:
    """Before, the float64 run failed and the floor was 0: PyTorch's own rounding failed the graph."""
    torch.manual_seed(0)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32) * 30}
    with TorchRuntime(NamesFloat32().eval(), [X], [Y]) as eager:
        outputs = eager.run(feeds)
        floor = eager.precision_floor(feeds, outputs)["y"]
    assert 0 < floor < 1e-2


def test_the_widened_run_rounds_nothing_to_a_narrower_float() -> None:
    x = torch.randn(8, dtype=torch.float64)
    assert float(in_float64(lambda x: ((x * 3).float() - x * 3).abs().max(), x)) == 0
    assert float(in_float64(lambda x: (x.half() - x).abs().max(), x)) == 0
    assert float(in_float64(lambda: (torch.tensor([1 / 3]) - 1 / 3).abs().max())) == 0
    assert float(in_float64(lambda x: (torch.eye(8, dtype=torch.float32) @ x - x).abs().max(), x)) == 0
    assert torch.get_default_dtype() == torch.float32  # restored


class Float32MaskAttention(torch.nn.Module):
    """Self-attention under a causal mask made as float32 (``torch.finfo(torch.float32).min``),
    whatever the query's dtype, as many hand-written decoders make it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)
        allowed = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias)
        return out.transpose(1, 2).reshape(x.shape)


def test_a_float32_mask_in_the_float64_run_does_not_become_tolerance() -> None:
    """Cast to double as a whole, this module runs: float64 SDPA with the float32 mask, which
    PyTorch reads wrong from 16 keys on (3.4 off). Taken as float32's own error, that floor
    let a graph 0.4 off pass at atol 10."""
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 24, 32)).astype(np.float32)}
    with TorchRuntime(Float32MaskAttention().eval(), [X], [Y]) as eager:
        outputs = eager.run(feeds)
        floor = eager.precision_floor(feeds, outputs)["y"]
    assert floor < 1e-5


class Bfloat16KeysAttention(torch.nn.Module):
    """Self-attention whose keys are rounded to bfloat16 on purpose, as a bfloat16 cache is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)
        k = q.to(torch.bfloat16).to(q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, q)
        return out.transpose(1, 2).reshape(x.shape)


def test_a_cast_the_module_makes_on_purpose_does_not_become_tolerance() -> None:
    """Widened, the float64 run drops the bfloat16 rounding: taken alone, its floor was the
    rounding itself, and a graph without the cast passed at atol 8.7."""
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 24, 32)).astype(np.float32)}
    with TorchRuntime(Bfloat16KeysAttention().eval(), [X], [Y]) as eager:
        outputs = eager.run(feeds)
        floor = eager.precision_floor(feeds, outputs)["y"]
    assert floor < 1e-5
