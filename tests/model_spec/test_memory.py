"""Memory budgets: a case that cannot fit is refused, in one line, before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import InputError, UsageError
from attn_export.model_spec import load_spec
from attn_export.model_spec.memory import case_bytes, check_memory, machine_memory, memory_budget, parse_bytes
from attn_export.model_spec.shapes import sweep
from tests.conftest import TINY_ZOO, ZOO, tiny_spec


def test_case_bytes_counts_inputs_outputs_and_the_largest_scores() -> None:
    spec = load_spec(ZOO / "sdpa.toml")
    sizes = {"batch": 8, "seq": 256, "kv_seq": 320}
    io = 4 * 8 * (256 * 64 + 320 * 64 + 320 * 96 + 256 * 96 + 256 * 320)
    scores = 4 * 8 * 320 * 320  # keys against keys: the largest rows x positions pair
    assert case_bytes(spec, sizes) == 2 * io + scores


def test_self_attention_scores_are_quadratic_in_the_one_length() -> None:
    spec = load_spec(ZOO / "mha.toml")
    assert case_bytes(spec, {"batch": 1, "seq": 1000}) - case_bytes(spec, {"batch": 1, "seq": 1}) > 4 * 1000 * 999


def test_dims_at_the_limit_are_refused_before_allocating(tmp_path: Path) -> None:
    path = tiny_spec(tmp_path)
    path.write_text(path.read_text().replace("max = 24", "max = 1048576").replace("max = 40", "max = 1048576"))
    spec = load_spec(path)
    with pytest.raises(InputError) as info:
        check_memory(spec, sweep(spec), machine_memory())
    assert str(info.value).startswith("tiny: case max (batch=4,seq=1048576,kv_seq=1048576) needs at least 16.0 TiB, ")
    assert str(info.value).endswith(
        "; narrow the dims or raise --max-memory (or $ATTN_EXPORT_MAX_MEMORY, or max_memory in the spec)"
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 << 30), ("512M", 512 << 20), ("1.5 GB", 3 << 29), ("1000000", 10**6), ("64kib", 65536)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text, "max_memory") == value


@pytest.mark.parametrize("text", ["nan", "inf", "²", "-1", "0", "12XB", ""])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(UsageError, match=r"is not a memory size like 8GiB, 512MiB or 1000000"):
        parse_bytes(text, "max_memory")


def test_budget_is_the_option_else_the_environment_else_the_checkout_spec_else_half_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ATTN_EXPORT_MAX_MEMORY", raising=False)
    path = tiny_spec(tmp_path)
    assert memory_budget(None, load_spec(path)) == machine_memory() // 2
    path.write_text('max_memory = "2MiB"\n' + path.read_text())
    assert memory_budget(None, load_spec(path)) == 2 << 20
    assert memory_budget(None) == machine_memory() // 2  # a manifest's spec is never passed
    monkeypatch.setenv("ATTN_EXPORT_MAX_MEMORY", "3MiB")
    assert memory_budget(None, load_spec(path)) == 3 << 20
    assert memory_budget(5 << 20, load_spec(path)) == 5 << 20


def test_verify_refuses_a_case_over_max_memory(zoo_dir: Path) -> None:
    sdpa = [str(zoo_dir / "sdpa.onnx"), "--models", str(TINY_ZOO)]
    result = CliRunner().invoke(cli, ["verify", *sdpa, "--no-latency", "--max-memory", "64KiB"])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        "Error: sdpa: case max (batch=4,seq=24,kv_seq=40) needs at least 135.0 KiB, over the memory budget of "
        "64.0 KiB; narrow the dims or raise --max-memory (or $ATTN_EXPORT_MAX_MEMORY, or max_memory in the spec)"
    )
    for text in ("lots", ""):  # an empty budget is no budget: refused, never read as none
        bad = CliRunner().invoke(cli, ["verify", *sdpa, "--max-memory", text])
        assert bad.exit_code == 2
        assert f"Error: Invalid value for '--max-memory': {text!r} is not a memory size like 8GiB" in bad.output
