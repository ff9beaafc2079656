"""Budgets belong to the person running the command: a manifest's max_memory is never
obeyed, recorded inputs are checked from their headers before any array is loaded (and a
FIFO is refused, not waited on), and build refuses a case over the budget before computing
it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import Built, copy_build, shared_build, tiny_spec


def test_a_manifest_cannot_lift_the_budget_of_golden_mode(tiny_build: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tiny_build.out / "manifest.json"
    doc = json.loads(manifest.read_text())
    for entry in doc["models"].values():
        entry["spec"]["max_memory"] = 1000 << 40  # 1000 TiB, as a hostile folder would say
    manifest.write_text(json.dumps(doc))
    monkeypatch.setenv("ATTN_EXPORT_MAX_MEMORY", "4KiB")
    result = CliRunner().invoke(cli, ["verify", str(tiny_build.out), "--golden", "--no-latency"])
    assert result.exit_code == 2, result.output
    assert re.search(r"golden arrays declare [\d.]+ KiB, over the memory budget of 4.0 KiB\n$", result.output)


@pytest.fixture
def recorded_build(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Built:
    """A copy of ``tiny_spec``'s build with recorded intermediates (built once per session)."""
    built = shared_build(
        tmp_path_factory, "tiny-recorded", lambda models: [tiny_spec(models)], record_intermediates=True
    )
    return copy_build(built, tmp_path)


def test_a_manifest_cannot_lift_the_budget_of_localize_golden(
    recorded_build: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """localize --golden took its budget from the manifest's max_memory: a folder saying
    1000 TiB had every recorded header it declared allocated."""
    manifest = recorded_build.out / "manifest.json"
    doc = json.loads(manifest.read_text())
    for entry in doc["models"].values():
        entry["spec"]["max_memory"] = 1000 << 40
    manifest.write_text(json.dumps(doc))
    monkeypatch.delenv("ATTN_EXPORT_MAX_MEMORY", raising=False)
    monkeypatch.setattr("attn_export.model_spec.memory.machine_memory", lambda: 8 << 10)  # half of it: 4 KiB
    result = CliRunner().invoke(cli, ["localize", str(recorded_build.out), "tiny", "--golden"])
    assert result.exit_code == 2, result.output
    assert re.search(r"intermediate values declare [\d.]+ KiB, over the memory budget of 4.0 KiB\n$", result.output)


def test_recorded_inputs_are_checked_against_the_budget_before_loading(tiny_build: Built, tmp_path: Path) -> None:
    inputs = tmp_path / "inputs.npz"
    big = np.zeros((4, 40, 16), np.float32)  # 10 KiB a tensor, 26 KiB in all
    np.savez(inputs, query=big[:, :24], keys=big, values=big)
    args = ["verify", str(tiny_build.out), "--models", str(tiny_build.models), "--no-latency", "--inputs", str(inputs)]
    result = CliRunner().invoke(cli, [*args, "--max-memory", "8KiB"])
    assert result.exit_code == 2, result.output
    assert f"{inputs}: its arrays declare 26.0 KiB, over the memory budget of 8.0 KiB" in result.output
    result = CliRunner().invoke(cli, [*args, "--max-memory", "40KiB"])
    assert result.exit_code == 2 and "case recorded (" in result.output and "over the memory budget" in result.output
    assert CliRunner().invoke(cli, args).exit_code == 0


def test_recorded_inputs_that_are_a_fifo_are_refused_at_once(tiny_build: Built, tmp_path: Path) -> None:
    fifo = tmp_path / "inputs.npz"
    os.mkfifo(fifo)
    args = ["verify", str(tiny_build.out), "--models", str(tiny_build.models), "--no-latency", "--inputs", str(fifo)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "refused: not a regular file (a device, FIFO or socket)" in result.output


def test_build_refuses_a_case_over_the_budget_before_computing_it(tiny_build: Built, tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    args = ["build", "--models", str(tiny_build.models), "--out", str(out), "--max-memory", "16KiB"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "over the memory budget of 16.0 KiB" in result.output
    assert not (out / "tiny.onnx").exists()


@pytest.mark.parametrize("decode", [False, True])
def test_bench_refuses_a_shape_over_the_budget_before_building(tmp_path: Path, decode: bool) -> None:
    from tests.conftest import TINY_ZOO

    spec = str(TINY_ZOO / ("mha_kv_cache.toml" if decode else "mha.toml"))
    shape = ["--decode", "--past", "0,24", "--batch", "4"] if decode else ["--seq", "8,4096"]
    args = ["bench", spec, "--out", str(tmp_path / "out"), *shape, "--max-memory", "16KiB"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "over the memory budget of 16.0 KiB" in result.output
    assert not (tmp_path / "out").exists()
