"""Fully masked rows where PyTorch and the graph both give NaN (nn.MultiheadAttention with
its attention weights, on a fully padded sequence): the build names allow_nan, and with it
the model builds and verifies."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import TINY_ZOO, write_spec


def _spec(models: Path, allow_nan: bool) -> None:
    text = (TINY_ZOO / "torch_mha.toml").read_text().replace("need_weights = false", "need_weights = true")
    assert "need_weights = true" in text and "[tolerance]\n" in text
    if allow_nan:
        text = text.replace("[tolerance]\n", "[tolerance]\nallow_nan = true\n")
    write_spec(models, "mha_weights", text)


@pytest.mark.slow
def test_nan_on_both_sides_of_a_fully_masked_row_names_allow_nan(tmp_path: Path) -> None:
    models, out = tmp_path / "models", tmp_path / "out"
    _spec(models, allow_nan=False)
    result = CliRunner().invoke(cli, ["build", "--models", str(models), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "fully masked rows (fully-padded-sequence): PyTorch and onnxruntime[cpu] both give NaN there; set " in (
        result.output
    )
    assert "[tolerance] allow_nan = true" in result.output
    _spec(models, allow_nan=True)
    assert CliRunner().invoke(cli, ["build", "--models", str(models), "--out", str(out)]).exit_code == 0
    verified = CliRunner().invoke(cli, ["verify", str(out), "--models", str(models), "--no-latency"])
    assert verified.exit_code == 0, verified.output
