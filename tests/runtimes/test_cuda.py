"""CUDA paths, run where onnxruntime-gpu and a GPU are present (skipped elsewhere, saying why)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.model_spec.inputs import make_feeds
from attn_export.runtimes.ort import OnnxRuntime
from tests.conftest import TINY_ZOO

pytestmark = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="onnxruntime-gpu with a CUDA device is not installed here (pip install 'attn-export[gpu]')",
)


def test_cuda_session_really_runs_on_cuda_and_matches_cpu(zoo_dir: Path) -> None:
    entry = load_manifest(zoo_dir).models["mha_cross"]
    spec = entry.model_spec
    feeds = make_feeds(spec, {"batch": 2, "seq": 3, "kv_seq": 7}, 0)
    with OnnxRuntime(zoo_dir / entry.file, spec.inputs, spec.outputs, provider="cuda") as gpu:
        assert gpu.session.get_providers()[0] == "CUDAExecutionProvider"
        got = gpu.run(feeds)
        gpu.prepare(feeds)()  # the IOBinding path used for timing
    with OnnxRuntime(zoo_dir / entry.file, spec.inputs, spec.outputs) as cpu:
        want = cpu.run(feeds)
    np.testing.assert_allclose(got["output"], want["output"], atol=1e-4, rtol=1e-3)


def test_verify_on_cuda_with_latency(zoo_dir: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "verify",
            str(zoo_dir / "sdpa.onnx"),
            str(zoo_dir / "mha_cross.onnx"),
            "--models",
            str(TINY_ZOO),
            "--provider",
            "cuda",
            "--latency-budget",
            "0.02",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "onnxruntime[cuda]" in result.output


def test_inspect_checks_cuda_kernels(zoo_dir: Path) -> None:
    result = CliRunner().invoke(cli, ["inspect", str(zoo_dir / "mha_attention_op.onnx"), "--provider", "cuda"])
    assert result.exit_code in (0, 1)
    assert "kernels:     cuda: " in result.output


def test_fp16_variant_verifies_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = CliRunner()
    args = ["build", "mha_causal", "--models", str(TINY_ZOO), "--out", str(out), "--variant", "fp16"]
    build = runner.invoke(cli, args)
    assert build.exit_code == 0, build.output
    args = [
        "verify",
        str(out),
        "--models",
        str(TINY_ZOO),
        "--provider",
        "cuda",
        "--no-latency",
        "--distribution",
        "normal",
    ]
    result = runner.invoke(cli, [*args, "--distribution", "tiny"])
    assert result.exit_code == 0, result.output


def test_verify_on_cuda_reads_where_each_node_ran(zoo_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    args = ["verify", str(zoo_dir / "mha_cross.onnx"), "--models", str(TINY_ZOO), "--provider", "cuda"]
    result = CliRunner().invoke(cli, [*args, "--no-latency", "--json", str(report)])
    (placement,) = json.loads(report.read_text())["placement"]
    assert (placement["provider"], placement["required"]) == ("CUDAExecutionProvider", True)
    assert placement["by_provider"].get("CUDAExecutionProvider", 0) > 0, placement
    # MatMul, Softmax, Add, Reshape and Transpose all have CUDA kernels: nothing falls back
    assert placement["fallbacks"] == [] and result.exit_code == 0, result.output
