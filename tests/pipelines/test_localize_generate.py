"""``localize --generate-step K --generate N`` and ``verify --generate N --localize``: a
generation that leaves PyTorch's is localized at its first differing step, on PyTorch's own
tokens and cache before it, and the node named is the one a fault was planted in."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from attn_export.checks.generate import GenerateResult
from attn_export.cli import cli
from attn_export.pipelines.localize import localize_failures
from attn_export.pipelines.verify.results import ModelCheck, VerifyOptions, VerifyReport
from tests.conftest import TINY_ZOO, Built, needs_transformers

pytestmark = [needs_transformers, pytest.mark.slow]  # a localize of a whole two-layer model: about 20 s each

SPEC = TINY_ZOO / "llama_causal_lm.toml"


@pytest.fixture
def faulty(causal_lm: Built, tmp_path: Path) -> Path:
    """The built causal LM with the second layer's output projection 1.5x too large on four of
    its input rows: a graph no build made, judged with the zoo's spec."""
    proto = onnx.load(str(causal_lm.out / "llama_causal_lm.onnx"))
    weights = {i.name: i for i in proto.graph.initializer}
    node = next(
        n
        for n in proto.graph.node
        if n.op_type == "MatMul" and any("layers.1.self_attn.o_proj" in p.value for p in n.metadata_props)
    )
    weight = next(weights[name] for name in node.input if name in weights)
    values = numpy_helper.to_array(weight).copy()
    values[:4] *= np.float32(1.5)
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    graph = tmp_path / "edited" / "llama_causal_lm.onnx"
    graph.parent.mkdir()
    onnx.save(proto, str(graph))
    shutil.copyfile(SPEC, tmp_path / "llama_causal_lm.toml")
    return graph


def _names_o_proj(text: str) -> bool:
    return "DIVERGES first at" in text and "layers.1.self_attn.o_proj" in text


def test_localize_at_a_generation_step_names_the_planted_node(faulty: Path) -> None:
    spec = faulty.parent.parent / "llama_causal_lm.toml"
    args = ["localize", str(faulty), "--spec", str(spec), "--generate-step", "2", "--generate", "3"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "at generate step 2 of batch-1" in result.output and _names_o_proj(result.output)
    assert "--generate-step 2 --generate 3 --layout batch-1 --seed 0" in result.output  # its reproduce line
    wrong = CliRunner().invoke(cli, ["localize", str(faulty), "--spec", str(spec), "--generate-step", "4"])
    assert wrong.exit_code == 2 and "--generate-step and --generate go together" in wrong.output


def test_verify_localize_takes_a_generation_that_alone_diverged(faulty: Path) -> None:
    """A report whose only failure is our loop's generation (as a fault outside the sweep's
    and the trajectories' reach gives): localized at that step of that layout."""
    spec = faulty.parent.parent / "llama_causal_lm.toml"
    options = VerifyOptions(spec_file=spec, generate_steps=3, latency=False)
    generation = GenerateResult("llama_causal_lm", "onnxruntime[cpu]", "batch-1", [[5, 6]], 3, step=2, divergence="x")
    genai = GenerateResult("llama_causal_lm", "onnxruntime-genai", "padded", [[5, 6]], 3, step=1, divergence="x")
    report = VerifyReport(
        artifacts=str(faulty.parent),
        seed=0,
        settings={},
        checks=[ModelCheck("llama_causal_lm", faulty.name)],
        generate=[genai, generation],  # genai's generator runs the graph its own way: not localized
    )
    (found,) = localize_failures(report, options)
    assert (found.generate_step, found.layout) == (2, "batch-1")
    assert found.first is not None and "layers.1.self_attn.o_proj" in found.first.module_path
