"""Whole Hugging Face decoders with their cache flat: any number of layers, the language-model
head, the families users bring, and one line for a model whose cache is no key/value pair."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.pipelines.building import BuildOptions, build_models
from tests.conftest import Built, needs_transformers, write_spec

pytestmark = needs_transformers

#: Families beside the zoo's Llama: their config (two layers, tiny) and cache heads x head size.
FAMILIES = {
    "qwen2": (
        'class = "transformers:Qwen2Config", hidden_size = 32, num_attention_heads = 4, num_key_value_heads = 2, '
        "intermediate_size = 64, max_position_embeddings = 64",
        2,
        8,
    ),
    "phi3": (
        'class = "transformers:Phi3Config", hidden_size = 32, num_attention_heads = 4, num_key_value_heads = 2, '
        "intermediate_size = 64, max_position_embeddings = 64, pad_token_id = 0",
        2,
        8,
    ),
    "gpt_neox": (
        'class = "transformers:GPTNeoXConfig", hidden_size = 32, num_attention_heads = 2, '
        "intermediate_size = 64, max_position_embeddings = 64",
        2,
        16,
    ),
    "gemma2": (
        'class = "transformers:Gemma2Config", hidden_size = 32, num_attention_heads = 4, num_key_value_heads = 2, '
        "head_dim = 8, intermediate_size = 64, max_position_embeddings = 64, sliding_window = 8",
        2,
        8,
    ),
    "bloom": ('class = "transformers:BloomConfig", hidden_size = 32, n_head = 2', 2, 16),
    "gpt2": ('class = "transformers:GPT2Config", n_embd = 32, n_head = 2, n_positions = 64', 2, 16),
    "mistral": (
        'class = "transformers:MistralConfig", hidden_size = 32, num_attention_heads = 4, '
        "num_key_value_heads = 2, intermediate_size = 64, max_position_embeddings = 64, sliding_window = 8",
        2,
        8,
    ),
}


def causal_lm_spec(
    folder: Path, name: str, config: str, heads: int, head_dim: int, layers: int = 2, vocab: int = 32
) -> Path:
    """A ``CausalLMWithCache`` spec of ``layers`` layers, its cache declared per layer."""
    count = "n_layer" if "GPT2" in config or "Bloom" in config else "num_hidden_layers"
    past = "".join(
        f'[[inputs]]\nname = "past_key_values.{i}.{k}"\nshape = ["batch", {heads}, "past_seq", {head_dim}]\n'
        for i in range(layers)
        for k in ("key", "value")
    )
    present = "".join(
        f'[[outputs]]\nname = "present.{i}.{k}"\nshape = ["batch", {heads}, "total_seq", {head_dim}]\n'
        for i in range(layers)
        for k in ("key", "value")
    )
    head = (
        'module = "attn_export.zoo.hf_cache:CausalLMWithCache"\n'
        f"config = {{ {config}, {count} = {layers}, vocab_size = {vocab} }}\naccept_guards = true\n"
    )
    body = head + (
        '[[inputs]]\nname = "input_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n'
        '[[inputs]]\nname = "attention_mask"\ndtype = "int64"\nshape = ["batch", "total_seq"]\n'
        'mask = "left-padding"\nconvention = "binary"\n'
        '[[inputs]]\nname = "position_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n'
        f'{past}[[outputs]]\nname = "logits"\nshape = ["batch", "seq", {vocab}]\n{present}'
        "[dims]\nbatch = { min = 1, max = 3 }\nseq = { min = 1, max = 8 }\npast_seq = { min = 0, max = 16 }\n"
        'total_seq = "past_seq + seq"\n'
    )
    return write_spec(folder, name, body)


def test_a_two_layer_causal_lm_gives_logits_and_every_layers_cache(causal_lm: Built) -> None:
    graph = onnx.load(str(causal_lm.out / "llama_causal_lm.onnx"), load_external_data=False)
    assert [o.name for o in graph.graph.output] == [
        "logits",
        "present.0.key",
        "present.0.value",
        "present.1.key",
        "present.1.value",
    ]
    assert [i.name for i in graph.graph.input][3:] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]


def test_a_two_layer_causal_lm_and_its_int4_graph_decode_like_pytorch(causal_lm: Built) -> None:
    args = ["--decode", "3", "--distribution", "normal", "--random", "0", "--no-latency"]  # the decode is the point
    result = CliRunner().invoke(cli, ["verify", str(causal_lm.out), "--models", str(causal_lm.models), *args])
    assert result.exit_code == 0, result.output
    assert "4 of 4 decode trajectories agree" in result.output  # fp32 and int4, batch 1 and left-padded


@pytest.mark.slow  # a build of its own (10 s)
@pytest.mark.parametrize(
    ("name", "edit"),
    [
        (
            "qwen2_ignore",
            lambda text: text.replace("accept_guards = true\n", 'accept_guards = true\nfully_masked = "ignore"\n'),
        ),
        ("qwen2_eager", lambda text: text.replace("vocab_size", 'attn_implementation = "eager", vocab_size')),
    ],
)
def test_padding_tokens_are_left_out_of_every_layers_cache_too(
    tmp_path: Path, name: str, edit: Callable[[str], str]
) -> None:
    """A left-padded prompt's padding tokens: their keys and values from the second layer on
    are computed from query rows that see no key.

    - Under ``fully_masked = "ignore"`` (what verify advises where only padded rows differ)
      those rows are not compared, and neither are those keys and values: a right 2-layer
      Llama was red at its first decode step, present.1.key 0.24 off there, PyTorch's fully
      masked rows and the graph's being different things.
    - Eager attention gives such a row the mean of every value, so those keys depend on how
      many tokens the pass holds: a right 2-layer model with its cache was called a module bug
      against its own one pass ("present.1.key: 256/480 elements"), at positions no real
      token reads."""
    config, heads, head_dim = FAMILIES["qwen2"]
    spec = causal_lm_spec(tmp_path / "models", name, config, heads, head_dim)
    spec.write_text(edit(spec.read_text()))
    summary = build_models([spec], BuildOptions(tmp_path / "out"))
    assert [r.error for r in summary.results] == [None]
    args = ["--decode", "3", "--distribution", "normal", "--random", "0", "--no-latency"]
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(spec.parent), *args])
    assert result.exit_code == 0, result.output
    assert "2 of 2 decode trajectories agree" in result.output


@pytest.mark.slow  # a build of its own (15 s)
def test_a_head_tied_to_the_embedding_builds_and_verifies_in_int4(tmp_path: Path) -> None:
    """Gemma2, Bloom and any model with ``tie_word_embeddings`` read the head's weight through
    a Transpose of the embedding's table, which the quantizer left in float32: their int4
    builds failed the smoke check against the simulation, which rounds the head."""
    config, heads, _ = FAMILIES["qwen2"]
    config = config.replace("hidden_size = 32", "hidden_size = 64") + ", tie_word_embeddings = true"
    # a table the exporter does not fold into a transposed copy (a vocab of 32 it does)
    spec = causal_lm_spec(tmp_path / "models", "qwen2_tied", config, heads, 16, vocab=256)
    summary = build_models([spec], BuildOptions(tmp_path / "out", variants=("int4",)))
    assert [r.error for r in summary.results] == [None]
    graph = onnx.load(str(tmp_path / "out" / "qwen2_tied.int4.onnx"))
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 2 * 7 + 1  # the head's too
    args = ["--decode", "2", "--distribution", "normal", "--random", "0", "--no-latency"]
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(spec.parent), *args])
    assert result.exit_code == 0, result.output


@pytest.mark.slow  # a build of its own and genai's generator (20 s)
def test_genais_padded_batch_under_a_short_sliding_window_is_said_at_build_and_in_the_failure(tmp_path: Path) -> None:
    """onnxruntime-genai pads on the right, and a window that counts positions counts the pad
    slots after a shorter prompt: its row then attends to fewer of its own tokens, and a
    2-layer Gemma2 (window 8) gave other tokens from step 4. That is the deployment's limit,
    not the graph's fault: the build says so for --target genai, and the failure says why."""
    import importlib.util

    config, heads, head_dim = FAMILIES["gemma2"]
    spec = causal_lm_spec(tmp_path / "models", "gemma2_sw", config + ', attn_implementation = "eager"', heads, head_dim)
    notes: list[str] = []
    summary = build_models([spec], BuildOptions(tmp_path / "out", target="genai"), on_notice=notes.append)
    assert [r.error for r in summary.results] == [None]
    assert notes == [
        "gemma2_sw: --target genai: onnxruntime-genai pads a batch's shorter prompts on the right, and the "
        "config's sliding_window = 8 counts positions, the pad slots after a shorter prompt among them (PyTorch "
        "pads on the left): past 8 positions such a row attends to fewer of its own tokens than alone, and its "
        "tokens may differ; batch 1 and prompts of one length are not affected"
    ]
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai not installed ([genai] extra): its padded batch is not run")
    args = ["--generate", "12", "--no-latency", "--distribution", "normal", "--random", "0"]
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(spec.parent), *args])
    failed = [line for line in result.output.splitlines() if line.startswith("FAIL ")]
    assert failed and all("onnxruntime-genai generate padded" in line for line in failed), result.output
    assert all(line.endswith("prompts of one length are not affected)") for line in failed), result.output
    # a failure it does not explain is not given the explanation: a file changed after the build
    config = tmp_path / "out" / "genai" / "gemma2_sw" / "genai_config.json"
    config.write_text(config.read_text() + " ")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(spec.parent), *args])
    changed = [line for line in result.output.splitlines() if line.startswith("FAIL ")]
    assert changed and all(line.endswith("changed after the build") or "sha256" in line for line in changed), changed
    assert not any("sliding_window" in line for line in changed), changed


@pytest.mark.slow  # a build of its own (10 s)
def test_gpt2s_conv1d_projections_are_quantized_by_int4_and_verify_against_its_simulation(tmp_path: Path) -> None:
    """GPT-2's Conv1D is ``torch.addmm``, a Gemm the int4 quantizer does not take: its int4
    graph had the LM head quantized and every projection of its layers in float32, and its
    build failed the smoke check on padded rows. Each Gemm is now a MatMul and an Add, the
    simulation rounds ``addmm`` as MatMulNBits does, and the graph is green against it."""
    config, heads, head_dim = FAMILIES["gpt2"]
    config += ", bos_token_id = 1, eos_token_id = 2"  # GPT2Config's 50256 is past the vocabulary of 32
    spec = causal_lm_spec(tmp_path / "models", "gpt2_int4", config, heads, head_dim)
    summary = build_models([spec], BuildOptions(tmp_path / "out", variants=("int4",)))
    assert [r.error for r in summary.results] == [None]
    ops = [n.op_type for n in onnx.load(str(tmp_path / "out" / "gpt2_int4.int4.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 2 * 4 + 1 and "Gemm" not in ops  # c_attn, c_proj, c_fc, mlp.c_proj; lm_head
    args = ["--decode", "3", "--random", "0", "--no-latency"]
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(spec.parent), *args])
    assert result.exit_code == 0, result.output
    assert "2 of 2 decode trajectories agree" in result.output


@pytest.mark.slow  # two layers, in the tests above, already take no signature of their own
def test_three_layers_need_no_new_signature(tmp_path: Path) -> None:
    config, heads, head_dim = FAMILIES["qwen2"]
    spec = causal_lm_spec(tmp_path / "models", "qwen2_three", config, heads, head_dim, layers=3)
    summary = build_models([spec], BuildOptions(tmp_path / "out"))
    assert [r.error for r in summary.results] == [None]
    graph = onnx.load(str(tmp_path / "out" / "qwen2_three.onnx"), load_external_data=False)
    assert sum(o.name.startswith("present.") for o in graph.graph.output) == 6


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            'class = "transformers:MambaConfig", hidden_size = 32, vocab_size = 32',
            "keeps a recurrent state, not a key/value cache",
        ),
        (  # said before transformers refuses sdpa for it, with a page of its own words
            'class = "transformers:MambaConfig", hidden_size = 32, attn_implementation = "sdpa", vocab_size = 32',
            "MambaForCausalLM keeps a recurrent state, not a key/value cache",
        ),
        (
            'class = "transformers:T5Config", d_model = 32, vocab_size = 32',
            "AutoModelForCausalLM has no model for T5Config",
        ),
    ],
)
def test_a_model_the_wrappers_cannot_flatten_is_one_line(tmp_path: Path, config: str, says: str) -> None:
    spec = causal_lm_spec(tmp_path / "models", "odd", config.replace(", vocab_size = 32", ""), 2, 16)
    result = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert "Traceback" not in result.output


def test_a_spec_without_position_ids_is_told_the_wrapper_takes_them(tmp_path: Path) -> None:
    """Bloom uses no positions, so a user left ``position_ids`` out: the wrapper took the first
    past as them and said "2 layers take 4 past tensors, got 3" of a spec declaring 4."""
    config, heads, head_dim = FAMILIES["bloom"]
    spec = causal_lm_spec(tmp_path / "models", "bloom_np", config, heads, head_dim)
    positions = '[[inputs]]\nname = "position_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n'
    spec.write_text(spec.read_text().replace(positions, ""))
    result = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert (
        "2 layers take input_ids, attention_mask, position_ids, then 4 past tensors (past_key_values.{i}.key/value), "
        'got 4 inputs after attention_mask (kwargs = { positions = "mask" } counts positions from the mask instead)'
    ) in result.output


@pytest.mark.slow
def test_every_family_builds_and_verifies(tmp_path: Path) -> None:
    """Qwen2, Phi-3, GPT-NeoX, Gemma2 (alternating window), Bloom (ALiBi), GPT-2 and Mistral:
    each two-layer causal LM builds, agrees with PyTorch on the whole sweep, and decodes
    like PyTorch at batch 1."""
    models = tmp_path / "models"
    for name, (config, heads, head_dim) in FAMILIES.items():
        causal_lm_spec(models, name, config, heads, head_dim)
    build = CliRunner().invoke(cli, ["build", "--models", str(models), "--out", str(tmp_path / "out")])
    assert build.exit_code == 0, build.output
    verify = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--models", str(models), "--decode", "3"])
    assert "104 of 104 cases agree across 7 models" in verify.output, verify.output
    batch_one = [line for line in verify.output.splitlines() if " batch-1 " in line]
    assert len(batch_one) == 7 and all(" PASS " in line for line in batch_one), verify.output


def test_positions_counted_from_the_mask_are_the_ones_generate_feeds() -> None:
    """``positions="mask"`` (onnxruntime-genai's model builder graphs take no position_ids):
    each token's index among the row's real tokens, as given to the input form."""
    import torch
    from transformers import LlamaConfig

    from attn_export.zoo.hf_cache import CausalLMWithCache

    config = LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=32, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    given = CausalLMWithCache(config).eval()
    counted = CausalLMWithCache(config, positions="mask").eval()
    counted.load_state_dict(given.state_dict())
    ids = torch.randint(3, 32, (2, 3))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])  # a past of 4, row 1 left-padded
    past = [torch.randn(2, 2, 4, 8) for _ in range(4)]
    positions = torch.tensor([[4, 5, 6], [2, 3, 4]])
    with torch.no_grad():
        want, got = given(ids, mask, positions, *past), counted(ids, mask, *past)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="positions must be one of 'input', 'mask'"):
        CausalLMWithCache(config, positions="ids")


def test_a_config_whose_fields_refuse_a_global_read_is_built(tmp_path: Path) -> None:
    """Gemma4TextConfig's head_dim differs per layer, and reading it whole raises its own
    error (not AttributeError): the check for misspelt keys takes it as the class's field."""
    from attn_export.exporter.factory import build_config
    from attn_export.model_spec import load_spec

    spec = causal_lm_spec(tmp_path / "models", "g4", 'class = "transformers:Gemma4TextConfig", head_dim = 256', 2, 16)
    assert type(build_config(load_spec(spec))).__name__ == "Gemma4TextConfig"


def test_a_short_window_is_read_off_the_config_its_class_makes(tmp_path: Path) -> None:
    """Qwen2 keeps its sliding_window off unless use_sliding_window asks: read off the table
    alone, a window of 8 was taken as in use, and genai's padded failures were given a
    window's explanation the model does not have."""
    from attn_export.exporter.factory import build_config
    from attn_export.model_spec import load_spec
    from attn_export.model_spec.cache import short_window

    config, heads, head_dim = FAMILIES["qwen2"]
    spec = load_spec(causal_lm_spec(tmp_path, "qwen2_sw", config + ", sliding_window = 8", heads, head_dim))
    assert short_window(spec, build_config(spec)) is None
    on = load_spec(
        causal_lm_spec(
            tmp_path, "qwen2_on", config + ", sliding_window = 8, use_sliding_window = true", heads, head_dim
        )
    )
    assert short_window(on, build_config(on)) == 8
    mistral, heads, head_dim = FAMILIES["mistral"]  # a class without the switch applies its window
    assert short_window(load_spec(causal_lm_spec(tmp_path, "m", mistral, heads, head_dim)), None) == 8


@pytest.mark.slow  # a build of its own (15 s)
def test_a_phi3_whose_rotary_switches_at_its_original_length_builds_and_verifies_across_it(tmp_path: Path) -> None:
    """Phi-3's longrope picks its frequencies by each call's largest position, writing them
    into a buffer before reading it: the build refused it ("each call depends on the calls
    before it"), though none does. Its graph now agrees on both sides of the switch."""
    import torch

    from attn_export.exporter.factory import instantiate
    from attn_export.model_spec import load_spec

    config, heads, head_dim = FAMILIES["phi3"]
    rope = (
        ", bos_token_id = 1, eos_token_id = 2, original_max_position_embeddings = 16, "
        'rope_scaling = { rope_type = "longrope", '
        "short_factor = [1.0, 1.2, 1.5, 2.0], long_factor = [2.0, 4.0, 8.0, 16.0], "
        "original_max_position_embeddings = 16 }"
    )
    spec = causal_lm_spec(tmp_path / "models", "phi3_longrope", config + rope, heads, head_dim)
    module = instantiate(load_spec(spec))
    ids, empty = torch.randint(3, 32, (1, 20)), [torch.zeros(1, heads, 0, head_dim)] * 4

    def logits(n: int) -> torch.Tensor:
        with torch.no_grad():
            return module(ids[:, :n], torch.ones(1, n, dtype=torch.int64), torch.arange(n)[None], *empty)[0]

    short, long = logits(10), logits(20)
    assert (short - long[:, :10]).abs().max() > 1e-4  # the same tokens at the same places: other frequencies
    build = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out"), "--target", "genai"])
    assert build.exit_code == 0, build.output
    args = ["verify", str(tmp_path / "out"), "--models", str(tmp_path / "models"), "--no-latency", "--generate", "4"]
    verify = CliRunner().invoke(cli, [*args, "--json", str(tmp_path / "r.json")])
    assert verify.exit_code == 0, verify.output
    totals = {c["sizes"]["total_seq"] for c in json.loads((tmp_path / "r.json").read_text())["cases"]}
    assert min(totals) <= 16 < max(totals), totals


@pytest.mark.slow  # two failed builds of its own (11 s)
def test_a_decoder_whose_export_fails_in_transformers_names_transformers_line(tmp_path: Path) -> None:
    """Dynamic NTK rotary rescales by the longest length seen so far, a branch on a value (and a
    state kept between calls): the failure named the adapter's call of the model
    (``hf_cache.py``), not the line in transformers that branches."""
    config, heads, head_dim = FAMILIES["qwen2"]
    dynamic = config.replace("max_position_embeddings = 64", "max_position_embeddings = 16")  # below the sweep's
    dynamic += ', rope_scaling = { rope_type = "dynamic", factor = 4.0 }'
    spec = causal_lm_spec(tmp_path / "models", "qwen2_dynamic", dynamic, heads, head_dim)
    build = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])
    assert build.exit_code == 1, build.output
    assert "at transformers/modeling_rope_utils.py:" in build.output and "hf_cache.py" not in build.output, build.output
    # the torchscript export fixes the branch at the example's length: its smoke check fails, in one
    # line, where torch's tracer (tracing the module's path there) printed a 120-line program first
    args = [sys.executable, "-m", "attn_export", "build", str(spec), "--out", str(tmp_path / "ts")]
    done = subprocess.run([*args, "--exporter", "torchscript"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "[smoke] qwen2_dynamic: smoke check at" in done.stdout, done.stdout
    assert "def forward(" not in done.stderr and len(done.stderr.splitlines()) < 5, done.stderr
