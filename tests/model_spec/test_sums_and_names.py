"""Specs that would fail late fail first, in one line: a sum of a sum (which build would
have met as a KeyError), and two spec files naming one model in one build (which would
have overwritten each other)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import TINY_ZOO, tiny_spec, write_spec


def test_a_sum_of_a_sum_is_a_one_line_spec_error(tmp_path: Path) -> None:
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text()
    text = text.replace('total_seq = "past_seq + seq"', 'total_seq = "past_seq + seq"\nextra = "total_seq + batch"')
    path = write_spec(tmp_path, "sums", text)
    for command in ("list", "build"):
        result = CliRunner().invoke(
            cli, [command, str(path), *(["--out", str(tmp_path / "out")] * (command == "build"))]
        )
        assert result.exit_code == 2, result.output
        assert "dim 'extra': a sum must add two or more distinct dims declared with {min, max}" in result.output
        assert "'total_seq' is not one (declared: batch, seq, past_seq)" in result.output  # a sum is not declared so
        assert "Traceback" not in result.output


def test_a_sum_of_a_misspelt_dim_names_it_and_the_dims_declared(tmp_path: Path) -> None:
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text().replace("past_seq = {", "past_sq = {")
    result = CliRunner().invoke(cli, ["list", str(write_spec(tmp_path, "typo", text))])
    assert result.exit_code == 2, result.output
    assert "got 'past_seq + seq': 'past_seq' is not one (declared: batch, seq, past_sq)" in result.output


def test_two_spec_files_naming_one_model_are_refused_before_building(tmp_path: Path) -> None:
    first, second = tiny_spec(tmp_path / "a"), tiny_spec(tmp_path / "b")
    result = CliRunner().invoke(cli, ["build", str(first), str(second), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"Error: {first} and {second} both name model 'tiny': one build folder holds one model of a name\n"
    )
    assert not (tmp_path / "out" / "manifest.json").exists()
