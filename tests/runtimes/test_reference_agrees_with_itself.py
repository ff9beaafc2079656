"""PyTorch is the reference only where it agrees with itself: a module that is random in
eval mode fails naming the cause (its randomness never becomes tolerance), and the float32
floor is PyTorch's own error at the run's threads or at one thread, whichever is larger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import NondeterministicModule
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.spec import TensorSpec
from attn_export.zoo.seed import MultiHeadAttention
from tests.conftest import tiny_spec

X = TensorSpec("x", "float32", ("batch", "seq", 32))
Y = TensorSpec("y", "float32", ("batch", "seq", 32))


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


class ThreadSensitive(torch.nn.Module):
    """Rounds differently on one thread: its float32 error there is 1e-3, elsewhere 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and torch.get_num_threads() == 1:
            return x + 1e-3
        return x


def _build(tmp_path: Path, module: type, exporter: str = "dynamo") -> object:
    spec = tiny_spec(tmp_path / "models", exporter=exporter)
    seed_mha = 'module = "attn_export.zoo.seed:MultiHeadAttention"'
    spec.write_text(spec.read_text().replace(seed_mha, _module_line(module)))
    return CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize(
    ("module", "said"),
    [
        (DropoutAlwaysAttention, "aten::scaled_dot_product_attention (dropout_p=0.1)"),
        (TinyDropoutAttention, "aten::scaled_dot_product_attention (dropout_p=1e-06)"),
        (DropoutTrainingAttention, "aten::native_dropout (p=0.1, train=True)"),
        (NoisyAttention, "aten::randn_like (a random draw)"),
    ],
)
def test_a_module_random_in_eval_fails_its_export_naming_the_op_and_line(
    tmp_path: Path, module: type, said: str
) -> None:
    """The exported graph drops dropout outside training, and a rare drop lets two runs of
    the module agree: the FX program is read, so the build fails every time, at the line."""
    result = _build(tmp_path, module)
    assert result.exit_code == 1, result.output
    assert f"[export] tiny: the module is random in eval mode: {said} at {__file__}:" in result.output
    assert not (tmp_path / "out" / "tiny.onnx").exists()


def test_a_module_without_draws_in_eval_builds(tmp_path: Path) -> None:
    result = _build(tmp_path, NoDropoutAttention)
    assert result.exit_code == 0, result.output


def test_a_module_random_in_eval_fails_the_torchscript_build_naming_pytorch(tmp_path: Path) -> None:
    """The torchscript exporter keeps no FX program: two runs of the module judge it."""
    result = _build(tmp_path, DropoutAlwaysAttention, exporter="torchscript")
    assert result.exit_code == 1, result.output
    assert "PyTorch is not deterministic in eval mode: two runs of the module on one input differ by" in result.output
    assert "dropout_p" in result.output
    assert not (tmp_path / "out" / "tiny.onnx").exists()


def _module_line(cls: type) -> str:
    return f'module = "{cls.__module__}:{cls.__name__}"'


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
