"""``verify GRAPH --spec`` on a graph Optimum exported (``tests/data``): the tiny zoo's
causal LM as ``optimum-cli export onnx --task text-generation-with-past`` writes it, judged by
the zoo's own spec with the checkpoint's weights. Optimum names its dims its own way
(``batch_size``, ``past_sequence_length + sequence_length``): a graph no build made may, one
name per dim."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import GraphCheckError
from attn_export.exporter.graph_checks import check_spec_axes
from attn_export.model_spec import load_spec
from tests.conftest import TINY_ZOO, needs_transformers

pytestmark = needs_transformers
DATA = Path(__file__).parent.parent / "data"


def _checkpoint_weights(path: Path) -> Path:
    """The state dict of the checkpoint Optimum exported (``tests/data/README.md``): a seeded
    LlamaForCausalLM, each key prefixed ``model.`` as ``CausalLMWithCache`` holds it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=32, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.save({f"model.{k}": v for k, v in LlamaForCausalLM(config).state_dict().items()}, path)
    return path


@pytest.fixture
def optimum(tmp_path: Path) -> tuple[Path, Path]:
    """The Optimum graph in a folder of its own, and the zoo spec reading its weights."""
    graph = tmp_path / "model.onnx"
    shutil.copyfile(DATA / "optimum_llama_causal_lm.onnx", graph)
    weights = _checkpoint_weights(tmp_path / "weights.pt")
    spec = tmp_path / "spec" / "llama_causal_lm.toml"
    spec.parent.mkdir()
    spec.write_text((TINY_ZOO / "llama_causal_lm.toml").read_text() + f'\n[weights]\npath = "{weights}"\n')
    return graph, spec


def test_a_dim_named_by_another_exporter_is_the_specs_dim_where_one_name_serves_it(optimum: tuple[Path, Path]) -> None:
    graph, spec_path = optimum
    proto, spec = onnx.load(str(graph)), load_spec(spec_path)
    with pytest.raises(GraphCheckError, match="named 'batch_size' in the graph, but the spec names that dim 'batch'"):
        check_spec_axes(proto, "optimum", spec)  # what a build must name as its spec does
    check_spec_axes(proto, "optimum", spec, own_names=False)
    for value in (*proto.graph.input, *proto.graph.output):  # seq and past_seq one symbol, as a trace can make
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "sequence_length":
                dim.dim_param = "past_sequence_length"
    with pytest.raises(GraphCheckError, match="merged into one symbol 'past_sequence_length'"):
        check_spec_axes(proto, "optimum", spec, own_names=False)


def test_optimums_graph_passes_the_sweep_decode_and_generation(optimum: tuple[Path, Path]) -> None:
    graph, spec = optimum
    result = CliRunner().invoke(
        cli, ["verify", str(graph), "--spec", str(spec), "--generate", "3", "--no-latency", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "verify PASSED: 14 of 14 cases agree" in result.output
    assert "2 of 2 decode trajectories agree" in result.output
    assert "4 of 4 generations give PyTorch's tokens" in result.output
