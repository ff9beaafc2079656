"""verify reads where each node ran, once per model and target, after the timed runs, and
--require-placement fails the cases of a target whose nodes fell back, naming the ops, in
every report. Without a GPU, a fallback is planted in the profile ONNX Runtime really wrote."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.pipelines.verify import VerifyOptions
from attn_export.runtimes import Target, placement
from tests.conftest import TINY_ZOO

#: One shape, no timing, no decoding: the placement is the subject.
ONE_CASE = ("--models", str(TINY_ZOO), "--shapes", "batch=2,seq=3,kv_seq=5", "--no-latency", "--decode", "0")
ELSEWHERE = "CUDAExecutionProvider"


def _plant(monkeypatch: pytest.MonkeyPatch, ops: set[str]) -> None:
    """Record ``ops`` as run on another provider in every profile verify reads."""
    real: Callable[[Path], list[dict[str, Any]]] = placement.read_profile

    def doctored(path: Path) -> list[dict[str, Any]]:
        events = real(path)
        for event in events:
            if event.get("cat") == "Node" and event["args"].get("op_name") in ops:
                event["args"]["provider"] = ELSEWHERE
        return events

    monkeypatch.setattr(placement, "read_profile", doctored)


def test_a_fallback_fails_with_require_placement_naming_the_ops_in_every_report(
    zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(monkeypatch, {"Softmax", "MatMul", "Concat"})  # mha_cross's Concats build shapes: int64 only
    files = {"json": tmp_path / "r.json", "junit": tmp_path / "r.xml", "markdown": tmp_path / "r.md"}
    args = ["verify", str(zoo_dir / "mha_cross.onnx"), *ONE_CASE, "--require-placement"]
    result = CliRunner().invoke(cli, [*args, *(a for k, p in files.items() for a in (f"--{k}", str(p)))])
    assert result.exit_code == 1, result.output
    gate = (
        f"placement: 6 of 22 nodes ran off CPUExecutionProvider: MatMul x5, Softmax x1 on {ELSEWHERE} "
        "(--no-require-placement to allow)"
    )
    assert f"FAIL mha_cross onnxruntime[cpu] shape-0 normal (seed 0): {gate}" in result.output
    assert (
        "mha_cross          onnxruntime[cpu]   FAIL   22 nodes, asked for CPUExecutionProvider; fallbacks: MatMul x5, "
        f"Softmax x1 on {ELSEWHERE}; shape ops: Concat x2 on {ELSEWHERE}"
    ) in result.output
    doc = json.loads(files["json"].read_text())
    (found,) = doc["placement"]
    assert (found["required"], found["passed"], found["provider"], found["nodes"]) == (
        True,
        False,
        "CPUExecutionProvider",
        22,
    )
    assert found["fallbacks"] == [
        {"op_type": "MatMul", "provider": ELSEWHERE, "count": 5},
        {"op_type": "Softmax", "provider": ELSEWHERE, "count": 1},
    ]
    assert found["shape_ops"] == [{"op_type": "Concat", "provider": ELSEWHERE, "count": 2}]
    assert len(doc["cases"]) == 4  # every value distribution at the one shape
    assert all(c["placement_gate"] == gate and not c["passed"] for c in doc["cases"])
    assert (doc["summary"]["placement_fallbacks"], doc["summary"]["failed_placements"]) == (1, 1)
    failure = ET.parse(files["junit"]).getroot().find("testsuite/testcase/failure")
    assert failure is not None and failure.get("message") == gate
    markdown = files["markdown"].read_text()
    row = "| mha_cross | onnxruntime[cpu] | 22 | **FAIL** | 22 nodes, asked for CPUExecutionProvider; fallbacks:"
    assert row in markdown
    assert f"- **mha_cross** onnxruntime[cpu] shape-0: {gate}" in markdown


def test_on_the_cpu_a_fallback_is_reported_not_failed_unless_required(
    zoo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(monkeypatch, {"Softmax"})
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir / "mha_cross.onnx"), *ONE_CASE])
    assert result.exit_code == 0, result.output
    assert f"WARN   22 nodes, asked for CPUExecutionProvider; fallbacks: Softmax x1 on {ELSEWHERE}" in result.output


def test_placement_is_required_by_default_on_every_provider_but_cpu() -> None:
    cpu, cuda = Target("onnxruntime", "cpu"), Target("onnxruntime", "cuda")
    assert not VerifyOptions().placement_required(cpu) and VerifyOptions().placement_required(cuda)
    assert VerifyOptions(require_placement=True).placement_required(cpu)
    assert not VerifyOptions(require_placement=False).placement_required(cuda)
    assert not VerifyOptions().placement_required(Target("onnx-reference"))


def test_placement_is_read_once_with_the_numbers_before_the_timing(
    zoo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A placement is a cell like a case's numbers; timing runs after them, alone (no profiled
    # session beside it: tests/pipelines/test_verify_scale.py holds every cell to that).
    from attn_export.pipelines.verify import cells
    from attn_export.runtimes.ort import OnnxRuntime

    order: list[str] = []
    timed, placed = cells.measure_alternating, OnnxRuntime.placement
    monkeypatch.setattr(cells, "measure_alternating", lambda *a, **k: order.append("timed") or timed(*a, **k))
    monkeypatch.setattr(OnnxRuntime, "placement", lambda self, feeds: order.append("placed") or placed(self, feeds))
    args = [a for a in ONE_CASE if a != "--no-latency"]
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir / "mha_cross.onnx"), *args, "--latency-budget", "0.002"])
    assert result.exit_code == 0, result.output
    assert order == ["placed", "timed"]
    assert "placement: every node ran on the provider asked for (models: 1, targets: 1, nodes: 22)" in result.output
