"""A module random in eval mode is refused from the FX program its graph is made from,
naming the op and its source line: the exported graph drops dropout outside training, and
a rare drop lets two runs of the module agree. Ops whose own arguments switch the draw off
in eval (a dropout probability of 0, a training flag that is False) are left alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tests.random_modules as random_modules
from attn_export.errors import NondeterministicModule
from attn_export.exporter.random_ops import refuse_random_ops
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes
from attn_export.runtimes.torch_eager import TorchRuntime, same_answer
from tests.checks.test_padded_rows import SPEC as PADDED_SPEC
from tests.conftest import build_tiny_with, tiny_spec, write_spec
from tests.random_modules import (
    AliasReadAttention,
    AttributeStateAttention,
    CountingAttention,
    DropoutAlwaysAttention,
    DropoutTrainingAttention,
    InPlaceInputAttention,
    KeptStateAttention,
    KeptWeightsAttention,
    NoDropoutAttention,
    NoisyAttention,
    OverwrittenStateAttention,
    ReadThenOverwrittenAttention,
    ReassignedStateAttention,
    TinyDropoutAttention,
)

SLOW = pytest.mark.slow


#: ``make test`` builds the rare drop, which two runs of the module miss; the slow set all.
@pytest.mark.parametrize(
    ("module", "said"),
    [
        pytest.param(DropoutAlwaysAttention, "aten::scaled_dot_product_attention (dropout_p=0.1)", marks=SLOW),
        (TinyDropoutAttention, "aten::scaled_dot_product_attention (dropout_p=1e-06)"),
        pytest.param(DropoutTrainingAttention, "aten::dropout (p=0.1, train=True)", marks=SLOW),
        pytest.param(NoisyAttention, "aten::randn_like (a random draw)", marks=SLOW),
    ],
)
def test_a_module_random_in_eval_fails_its_export_naming_the_op_and_line(
    tmp_path: Path, module: type, said: str
) -> None:
    result = build_tiny_with(tmp_path, module)
    assert result.exit_code == 1, result.output
    assert f"[export] tiny: the module is random in eval mode: {said} at {random_modules.__file__}:" in result.output
    assert not (tmp_path / "out" / "tiny.onnx").exists()


@pytest.mark.parametrize(
    ("module", "state", "line"),
    [
        (CountingAttention, "buffer 'calls'", "self.calls.add_(1)"),
        pytest.param(KeptStateAttention, "buffer 'last'", "self.last[0] = out[0, 0, 0]", marks=SLOW),
        pytest.param(AttributeStateAttention, "tensor attribute 'last'", "self.last[1] = out[0, 0, 0]", marks=SLOW),
        pytest.param(ReassignedStateAttention, "tensor attribute 'last'", "self.last = self.last + 1", marks=SLOW),
        pytest.param(
            ReadThenOverwrittenAttention,
            "buffer 'gain'",
            "self.gain.copy_(torch.where(query.abs().max() > 1, torch.tensor(4.0), torch.tensor(0.25)))",
            marks=SLOW,
        ),
        pytest.param(
            AliasReadAttention,
            "buffer 'gain'",
            "self.gain.copy_(torch.where(query.abs().max() > 1, torch.tensor(3.0), torch.tensor(0.75)))",
            marks=SLOW,
        ),
    ],
)
def test_a_module_that_updates_its_state_fails_its_export_naming_the_line(
    tmp_path: Path, module: type, state: str, line: str
) -> None:
    """Its drift is below rounding on the second call: only the FX program shows the update,
    of a buffer or of a plain tensor attribute (written in place, or assigned anew and read)."""
    result = build_tiny_with(tmp_path, module)
    assert result.exit_code == 1, result.output
    source = Path(random_modules.__file__).read_text().splitlines()
    number = next(i for i, text in enumerate(source, 1) if text.strip() == line)
    at = f"{random_modules.__file__}:{number} `{line}`"
    assert f"[export] tiny: forward() updates the module's {state} at {at}" in result.output, result.output
    assert not (tmp_path / "out" / "tiny.onnx").exists()


def test_a_module_that_writes_to_its_inputs_is_run_on_copies(tmp_path: Path) -> None:
    """PyTorch runs on copies of the feeds: two runs on one input agree, and the feeds the
    graph is given stay the values the module was."""
    spec = load_spec(tiny_spec(tmp_path))
    feeds = make_feeds(spec, example_sizes(spec), 0)
    given = {k: v.copy() for k, v in feeds.items()}
    with TorchRuntime(InPlaceInputAttention(hidden_dim=16, num_heads=2).eval(), spec.inputs, spec.outputs) as eager:
        same_answer(eager.run(feeds), eager.run(feeds))
    assert all(np.array_equal(feeds[k], given[k]) for k in feeds)


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(NoDropoutAttention, marks=SLOW),  # a whole build (3 s); the stock layers below check the same
        pytest.param(KeptWeightsAttention, marks=SLOW),
        OverwrittenStateAttention,
    ],
)
def test_a_module_without_draws_or_state_in_eval_builds(tmp_path: Path, module: type) -> None:
    """Nor is an attribute refused that forward() assigns but never reads back, nor a buffer
    written whole from the call's own values before it is read (transformers' longrope: a
    stock Phi-3 was refused, "each call depends on the calls before it", though none does)."""
    result = build_tiny_with(tmp_path, module)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "layer",
    [
        lambda: torch.nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True),
        lambda: torch.nn.GRU(8, 8, num_layers=2, dropout=0.3, batch_first=True),
        lambda: torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.3, batch_first=True),
        lambda: torch.nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True),
    ],
    ids=["LSTM", "GRU", "TransformerEncoderLayer", "MultiheadAttention"],
)
def test_stock_layers_with_dropout_are_not_random_in_eval(layer: object) -> None:
    class Call(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer()  # type: ignore[operator]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x, x, x) if isinstance(self.layer, torch.nn.MultiheadAttention) else self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    module = Call()
    with torch.no_grad():
        refuse_random_ops(torch.export.export(module.eval(), (torch.randn(2, 3, 8),), strict=False), "m")
        trained = torch.export.export(module.train(), (torch.randn(2, 3, 8),), strict=False)
    with pytest.raises(NondeterministicModule, match="the module is random in eval mode"):
        refuse_random_ops(trained, "m")  # the same layers in training draw: the check reads them


def test_a_masked_module_random_in_eval_is_not_blamed_on_its_mask(tmp_path: Path) -> None:
    """Build probes the masks with the module before it exports: a random module fails
    there as random, not as a mask read the wrong way."""
    from click.testing import CliRunner

    from attn_export.cli import cli

    spec = PADDED_SPEC.replace("{rule}", "").replace(
        "tests.checks.test_padded_rows:LeftPaddedCausalAttention", "tests.random_modules:MaskedDropoutAttention"
    )
    path = write_spec(tmp_path / "models", "masked", spec.replace('"left-padding"', '"padding"'))
    result = CliRunner().invoke(cli, ["build", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "PyTorch is not deterministic in eval mode" in result.output and "convention" not in result.output
