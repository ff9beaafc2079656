"""``verify GRAPH --spec`` on the graph onnxruntime-genai's model builder writes for a tiny
Llama: packed QKV, one GroupQueryAttention with rotary inside per layer, positions from the
mask (no ``position_ids``), every past key before the first past value, a head size named
``kv_cache_dim``, and a constant whose declared shape onnx's strict inference rejects. The
spec judges it by ``CausalLMWithCache(positions="mask")`` of the same weights, with the mask
it is fed (``full``) and the steps it is fed (``[cache] extend_batch = 1``)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import needs_transformers

pytestmark = [
    needs_transformers,
    pytest.mark.slow,  # the builder and three verifies: about 30 s
    pytest.mark.skipif(
        importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed ([genai] extra)"
    ),
]

#: Hidden 64 and vocab 48: at hidden 32 = vocab 32 the builder takes a 32-wide Linear for the
#: LM head, and its CPU GroupQueryAttention wants a head size that is a multiple of 16.
CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "vocab_size": 48, "max_position_embeddings": 64,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def _spec(weights: Path, mask: str = "full", cache: str = "[cache]\nextend_batch = 1\n") -> str:
    config = ", ".join(f"{k} = {v}" for k, v in CONFIG.items())
    pasts = "".join(
        f'[[inputs]]\nname = "past_key_values.{i}.{kv}"\nshape = ["batch_size", 2, "past_sequence_length", 16]\n'
        for i in range(2)
        for kv in ("key", "value")
    )
    presents = "".join(
        f'[[outputs]]\nname = "present.{i}.{kv}"\nshape = ["batch_size", 2, "total_sequence_length", 16]\n'
        for i in range(2)
        for kv in ("key", "value")
    )
    return (
        'module = "attn_export.zoo.hf_cache:CausalLMWithCache"\nkwargs = { positions = "mask" }\n'
        f'config = {{ class = "transformers:LlamaConfig", {config}, attn_implementation = "sdpa" }}\n'
        f'accept_guards = true\n[weights]\npath = "{weights}"\n'
        '[[inputs]]\nname = "input_ids"\ndtype = "int64"\nshape = ["batch_size", "sequence_length"]\n'
        '[[inputs]]\nname = "attention_mask"\ndtype = "int64"\nshape = ["batch_size", "total_sequence_length"]\n'
        f'mask = "{mask}"\nconvention = "binary"\n{pasts}'
        '[[outputs]]\nname = "logits"\nshape = ["batch_size", "sequence_length", 48]\n'
        f"{presents}[dims]\nbatch_size = {{ min = 1, max = 4 }}\nsequence_length = {{ min = 1, max = 16 }}\n"
        "past_sequence_length = { min = 0, max = 24 }\n"
        'total_sequence_length = "past_sequence_length + sequence_length"\n'
        f"{cache}[tolerance]\natol = 1e-5\nrtol = 1e-4\n"
    )


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The builder's fp32 CPU folder of a seeded checkpoint (its int4 folder beside it, in
    ``genai-int4``), and the checkpoint's weights as ``CausalLMWithCache`` holds them (each
    key prefixed ``model.``)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("genai-builder")
    checkpoint = root / "checkpoint"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(checkpoint)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, CONFIG["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="t3"
    ).save_pretrained(checkpoint)
    for precision, out in (("fp32", root / "genai"), ("int4", root / "genai-int4")):
        subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
             "-p", precision, "-e", "cpu", "-c", str(root / "cache")],
            check=True, capture_output=True,
        )  # fmt: skip
    weights = root / "weights.pt"
    torch.save({f"model.{k}": v for k, v in model.state_dict().items()}, weights)
    return root / "genai", weights


def _verify(graph: Path, spec: Path, *more: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["verify", str(graph), "--spec", str(spec), "--no-latency", *more])
    return result.exit_code, result.output


def test_the_builders_graph_verifies_in_our_loop_and_in_genai(builder: tuple[Path, Path], tmp_path: Path) -> None:
    folder, weights = builder
    spec = tmp_path / "spec" / "llama_builder.toml"
    spec.parent.mkdir()
    spec.write_text(_spec(weights))
    code, out = _verify(folder / "model.onnx", spec, "--generate", "4")
    assert code == 0, out
    assert "Inferred shape and existing shape differ in rank" in out  # a note, not a failure
    assert "batch_size=4,sequence_length=1" in out and "batch_size=4,sequence_length=5,past_sequence_length=0" in out
    # its GroupQueryAttention reads each row's length off the mask: our loop pads the batch on
    # the right, as genai's generator does (before, with no variant to say so, it ran prompts of one length alone)
    assert "onnxruntime-genai  padded" in out and "6 of 6 generations give PyTorch's tokens" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("llama_builder ")]
    assert ["onnxruntime[cpu]", "padded"] in [r[1:3] for r in rows], out
    assert ["onnxruntime[cpu]", "same-length"] in [r[1:3] for r in rows], out
    assert ["onnxruntime[cpu]", "full-batch"] in [r[1:3] for r in rows], out


def test_a_wrong_attention_scale_in_the_builders_graph_is_red(builder: tuple[Path, Path], tmp_path: Path) -> None:
    folder, weights = builder
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    proto = onnx.load(str(edited / "model.onnx"), load_external_data=False)
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    scale = next(a for a in gqa.attribute if a.name == "scale")
    scale.f = 0.3  # 1/sqrt(16) = 0.25
    onnx.save(proto, str(edited / "model.onnx"))
    spec = tmp_path / "spec" / "llama_builder.toml"
    spec.parent.mkdir()
    spec.write_text(_spec(weights))
    code, out = _verify(edited / "model.onnx", spec)
    assert code == 1, out
    assert "FAIL builder" not in out and "logits:" in out and "verify FAILED" in out
    # its nodes name no FX node: localize says why in one line, for a variant too (whose plain
    # graph, built from the spec, has them: it said "the graph of another module or export?")
    found = CliRunner().invoke(cli, ["localize", str(edited / "model.onnx"), "--spec", str(spec)])
    assert found.exit_code == 2 and "localize needs a graph from the dynamo exporter" in found.output, found.output
    int4 = folder.parent / "genai-int4" / "model.onnx"
    found = CliRunner().invoke(cli, ["localize", str(int4), "--spec", str(spec), "--variant", "int4"])
    assert found.exit_code == 2 and found.output.count("\n") == 1, found.output
    assert "its nodes carry no FX node metadata, which torch.onnx's dynamo exporter writes" in found.output


def test_steps_the_generator_never_feeds_are_refused_by_the_graph_and_the_report_says_what_to_declare(
    builder: tuple[Path, Path], tmp_path: Path
) -> None:
    folder, weights = builder
    spec = tmp_path / "spec" / "llama_builder.toml"
    spec.parent.mkdir()
    spec.write_text(_spec(weights, cache=""))
    code, out = _verify(folder / "model.onnx", spec, "--decode", "0")
    assert code == 1
    assert "batch_size must be 1 when sequence_length > 1 and past context is given" in out
    assert "declare [cache] extend_batch = 1 in the spec" in out


def test_the_builders_int4_graph_generates_the_int4_rounded_modules_tokens(
    builder: tuple[Path, Path], tmp_path: Path
) -> None:
    """genai's CPU int4 (MatMulNBits at accuracy level 4: int8 activations) against the module
    rounded as it computes: the logits to float32 noise, so they are held to float32's room."""
    folder, weights = builder
    spec = tmp_path / "spec" / "llama_builder.toml"
    spec.parent.mkdir()
    spec.write_text(_spec(weights))
    one = "batch_size=1,sequence_length=3,past_sequence_length=2"
    graph = folder.parent / "genai-int4" / "model.onnx"
    code, out = _verify(graph, spec, "--variant", "int4", "--shapes", one, "--generate", "4")
    assert code == 0, out
    assert "6 of 6 generations give PyTorch's tokens" in out
