"""``gqa-rotary``: rotary inside GroupQueryAttention, one packed projection per layer and each
row's length read off the mask, as onnxruntime-genai's graphs are; a spec whose positions are
not the cache's count is refused in one line before anything is exported."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import helper, numpy_helper

from attn_export.cli import cli
from attn_export.exporter.packed_projections import PACKED
from tests.conftest import TINY_ZOO, Built, needs_transformers, shared_build

pytestmark = needs_transformers
HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
VARIANT = "static-cache+gqa-rotary"
NAME = f"llama_causal_lm.{VARIANT}"


def _genai_form(text: str) -> str:
    """The tiny zoo's causal LM as onnxruntime-genai's graphs are fed: positions counted from a
    mask that takes no padding, heads of 16 (GroupQueryAttention's rotary wants a multiple of
    16), a buffer of 40 positions, several new tokens on a filled cache at batch 1 only."""
    text = text.replace('module = "attn_export.zoo.hf_cache:CausalLMWithCache"\n', "")
    text = 'module = "attn_export.zoo.hf_cache:CausalLMWithCache"\nkwargs = { positions = "mask" }\n' + text
    text = text.replace(
        "num_attention_heads = 4, num_key_value_heads = 2", "num_attention_heads = 2, num_key_value_heads = 1"
    )
    text = text.replace('2, "past_seq", 8]', '1, "past_seq", 16]').replace('2, "total_seq", 8]', '1, "total_seq", 16]')
    text = text.replace('mask = "left-padding"', 'mask = "full"')
    text = text.replace('[[inputs]]\nname = "position_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n', "")
    text = text.replace("opset = 18\n", "opset = 23\n")  # the variant's: one export, not the plain one's too
    return text + "\n[cache]\nmax_seq = 40\nextend_batch = 1\n"


def _write(folder: Path, text: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llama_causal_lm.toml").write_text(text)
    return [folder / "llama_causal_lm.toml"]


def _built_from(factory: pytest.TempPathFactory, key: str, text: str) -> Built:
    """The spec ``text`` built once per run under ``key``, with its genai folder."""
    made = shared_build(factory, key, lambda folder: _write(folder, text), target="genai", variants=(VARIANT,))
    assert made.errors == {NAME: None}, made.errors
    return made


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    text = _genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())
    made = shared_build(
        tmp_path_factory, "gqa-rotary", lambda folder: _write(folder, text), target="genai", variants=(VARIANT,)
    )
    assert made.errors == {NAME: None}, made.errors
    return made


def _red_on_logits(proto: onnx.ModelProto, made: Built, tmp_path: Path) -> None:
    """``proto``, an edit of ``made``'s graph, verified with its spec: red on the logits."""
    edited = tmp_path / "edited.onnx"
    onnx.save(proto, str(edited))
    shutil.copy(made.models / "llama_causal_lm.toml", tmp_path / "spec.toml")
    code, out = _verify(edited, made.models, "--spec", str(tmp_path / "spec.toml"), "--variant", VARIANT)
    assert code == 1, out
    assert "FAIL" in out and "logits" in out, out


def _verify(graph: Path, models: Path, *more: str) -> tuple[int, str]:
    args = ["verify", str(graph), "--no-latency", "--generate", "4", *more]
    if graph.is_dir():
        args += ["--models", str(models)]
    result = CliRunner().invoke(cli, args)
    return result.exit_code, result.output


def test_the_graph_has_genais_shape_and_gives_pytorchs_tokens(built: Built) -> None:
    """No RotaryEmbedding, no mask bias: each layer's GroupQueryAttention rotates with the
    shared cos/sin caches, reads one packed projection (its record kept for localization)
    and each row's length off the mask, and each residual sum is normed in the op that adds
    it. The padded batch genai's generator makes (padded on
    the right) gives each prompt's own tokens; the extend_batch spec builds (its smoke check
    is fed as the spec says)."""
    proto = onnx.load(str(built.out / f"{NAME}.onnx"))
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["RotaryEmbedding"] == ops["Cos"] == ops["Where"] == ops["Transpose"] == 0, ops
    attention = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2
    for node in attention:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 1 and node.input[1] == node.input[2] == ""
        assert node.input[7] and node.input[8] and (len(node.input) < 11 or node.input[10] == "")
    packed = [n for n in proto.graph.node if any(p.key == PACKED for p in n.metadata_props)]
    assert len(packed) == 2
    assert len({n.input[7] for n in attention}) == 1  # one cos cache for both layers
    assert len({n.input[6] for n in attention}) == 1  # one total length, the mask's width
    assert ops["Add"] == 0 and ops["RMSNormalization"] == 1, ops  # residual sums normed as genai's
    assert ops["SkipSimplifiedLayerNormalization"] == 4, ops
    cos = numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == attention[0].input[7]))
    assert cos.shape == (40, 8)  # the buffer's 40 positions, half a head
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))  # Llama's, heads of 16
    angles = torch.arange(40, dtype=torch.float32)[:, None] * inv_freq
    assert np.array_equal(cos, torch.cos(angles).numpy())  # torch's, as the module's each step
    config = json.loads((built.out / "genai" / NAME / "genai_config.json").read_text())
    assert "position_ids" not in config["model"]["decoder"]["inputs"]
    deployed = onnx.load(str(built.out / "genai" / NAME / "model.onnx"), load_external_data=False)
    assert not [n.name for n in deployed.graph.node if "past_length" in (*n.input, *n.output)]  # no dead nodes
    code, out = _verify(built.out, built.models)
    assert code == 0, out
    ours = [line.split()[1:5] for line in out.splitlines() if " onnxruntime[cpu] " in line]
    assert ["onnxruntime[cpu]", "padded", "6,3", "PASS"] in ours, out  # our loop pads on the right as genai does
    if HAS_GENAI:
        assert "onnxruntime-genai  padded" in out and "6 of 6 generations" in out, out


#: Other families the whole-decoder adapter takes, in the tiny zoo's sizes: the config class
#: that stands for Llama's, the fields it adds, and the head size.
FAMILIES = {
    "qwen2": ("Qwen2Config", "", 16),  # q/k/v biases: packed with their sum
    "phi3": ("Phi3Config", "", 16),  # its own packed qkv_proj, cut into heads by Slices
    "gemma": ("GemmaConfig", " head_dim = 32,", 32),  # heads wider than hidden / heads, scaled embeddings
}


def test_the_genai_folders_own_graph_verifies_with_its_spec(built: Built) -> None:
    """The graph a user ships, the genai folder's (its filled length derived from the mask),
    verifies with ``--spec`` as the build's graph does, its buffers driven in place. Before,
    it had lost its cache interface and was red on the buffers' axis ('max_seq' where the
    spec says total_seq)."""
    graph = built.out / "genai" / NAME / "model.onnx"
    spec = built.models / "llama_causal_lm.toml"
    code, out = _verify(graph, built.models, "--spec", str(spec), "--variant", VARIANT)
    assert code == 0, out
    assert "generations give PyTorch's tokens" in out, out


@pytest.mark.slow  # a build and a verify per family: about 40 s each
@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_read_one_packed_projection_and_verify_green(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """Each layer's GroupQueryAttention reads the one projection a layer packs (Phi-3's own
    ``qkv_proj``; the build failed on it before) and hands on its output as it is (Phi-3's
    Reshape to the shape the heads have kept 3 Reshapes and 2 Transposes a layer before),
    and the graph gives PyTorch's tokens."""
    text = _genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())
    config, fields, head = FAMILIES[family]
    text = text.replace('LlamaConfig",', f'{config}",{fields}').replace(", 16]", f", {head}]")
    made = _built_from(tmp_path_factory, f"gqa-rotary-{family}", text)
    proto = onnx.load(str(made.out / f"{NAME}.onnx"))
    attention = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2 and all(n.input[1] == n.input[2] == "" for n in attention)
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["Reshape"] == ops["Transpose"] == 0, ops  # the op's output as the module's, no layout ops
    code, out = _verify(made.out, made.models)
    assert code == 0, out
    if HAS_GENAI:
        assert "6 of 6 generations" in out, out


#: Families turning part of each head (a partial rotary), in sizes whose turned channels
#: GroupQueryAttention takes (a multiple of 16): heads of 32, half of each turned.
PARTIAL = {
    "phi3": lambda t: t.replace('LlamaConfig",', 'Phi3Config", partial_rotary_factor = 0.5, head_dim = 32,'),
    "gpt_neox": lambda t: t.replace('LlamaConfig",', 'GPTNeoXConfig", rotary_pct = 0.5,').replace(
        "num_attention_heads = 2", "num_attention_heads = 1"
    ),  # one head of the hidden 32: its heads are hidden / heads wide
    "phi": lambda t: t.replace('LlamaConfig",', 'PhiConfig", partial_rotary_factor = 0.5,').replace(
        "num_attention_heads = 2", "num_attention_heads = 1"
    ),  # phi-2: LayerNorm, attention and MLP side by side
    "stablelm": lambda t: t.replace('LlamaConfig",', 'StableLmConfig", partial_rotary_factor = 0.5,').replace(
        "num_attention_heads = 2", "num_attention_heads = 1"
    ),
}


def _partial_build(factory: pytest.TempPathFactory, family: str) -> Built:
    text = PARTIAL[family](_genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())).replace(", 16]", ", 32]")
    return _built_from(factory, f"gqa-rotary-partial-{family}", text)


@pytest.mark.slow  # a build and a verify per family: about 35 s each
@pytest.mark.parametrize("family", PARTIAL)
def test_a_partial_rotary_is_folded_with_caches_as_wide_as_it_turns(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """Half of each head of 32 turned: caches 8 wide (torch's cos for 16 channels), which
    GroupQueryAttention reads as turning 16 channels and passing the other 16 on, and the
    graph gives PyTorch's tokens (the build refused it before)."""
    made = _partial_build(tmp_path_factory, family)
    proto = onnx.load(str(made.out / f"{NAME}.onnx"))
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["RotaryEmbedding"] == ops["Cos"] == 0 and ops["GroupQueryAttention"] == 2, ops
    attention = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    cos = numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == attention.input[7]))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    assert np.array_equal(cos, torch.cos(torch.arange(40, dtype=torch.float32)[:, None] * inv_freq).numpy())
    code, out = _verify(made.out, made.models)
    assert code == 0, out
    if HAS_GENAI:
        assert "6 of 6 generations" in out, out


@pytest.mark.slow  # a verify of an edited graph: about 10 s (the build is the test above's)
def test_caches_as_wide_as_the_whole_head_on_a_partial_rotary_are_red(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The caches' width is what tells the op to pass channels on: caches for the whole
    head (16 wide) turn all 32 channels of each, and verify says so."""
    made = _partial_build(tmp_path_factory, "phi3")
    proto = onnx.load(str(made.out / f"{NAME}.onnx"))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
    angles = torch.arange(40, dtype=torch.float32)[:, None] * inv_freq
    for cache in proto.graph.initializer:
        for label, fn in (("cos_cache", torch.cos), ("sin_cache", torch.sin)):
            if label in cache.name:
                cache.CopyFrom(numpy_helper.from_array(fn(angles).numpy(), cache.name))
    _red_on_logits(proto, made, tmp_path)


@pytest.mark.slow  # an export: about 15 s
def test_a_partial_rotary_the_op_cannot_turn_is_refused_naming_it(tmp_path: Path) -> None:
    """Phi-3 turning half of heads of 16: 8 channels, caches 4 wide, which ONNX Runtime
    refuses (a multiple of 8 wide); the refusal said a module without rotary had nothing
    to fold before."""
    text = _genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())
    text = text.replace('LlamaConfig",', 'Phi3Config", partial_rotary_factor = 0.5,')
    (spec,) = _write(tmp_path / "models", text)
    result = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out"), "--variant", VARIANT])
    assert result.exit_code == 1, result.output
    (failure,) = [line for line in result.output.splitlines() if "FAILED" in line]
    assert "turns 8 channels of heads of 16 (a partial rotary" in failure, failure
    assert "turns a multiple of 16 (its cos/sin caches a multiple of 8 wide)" in failure, failure


@pytest.mark.slow  # a verify of an edited graph: about 10 s
def test_a_cos_cache_one_position_off_is_red(built: Built, tmp_path: Path) -> None:
    proto = onnx.load(str(built.out / f"{NAME}.onnx"))
    cos = next(t for t in proto.graph.initializer if "cos_cache" in t.name)
    cos.CopyFrom(numpy_helper.from_array(np.roll(numpy_helper.to_array(cos), 1, axis=0), cos.name))
    _red_on_logits(proto, built, tmp_path)


@pytest.mark.slow  # a verify with generations and a localize: about 25 s
def test_a_graph_that_takes_every_row_as_long_as_the_longest_is_red_on_the_padded_batch(
    built: Built, tmp_path: Path
) -> None:
    """Each row's length read off the mask's width, not its ones: right on prompts of one
    length, wrong on a row padded on the right, which our loop runs without genai's generator.
    Its step cannot be localized on the module's cache, laid out another way: one line."""
    proto = onnx.load(str(built.out / f"{NAME}.onnx"))
    attention = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    lengths, total = attention[0].input[5], attention[0].input[6]
    proto.graph.initializer.append(numpy_helper.from_array(np.array(1, np.int32), "one"))
    at = list(proto.graph.node).index(attention[0])
    for i, node in enumerate(
        [
            helper.make_node("Sub", [total, "one"], ["longest"]),
            helper.make_node("Shape", [lengths], ["rows"]),
            helper.make_node("Expand", ["longest", "rows"], ["as_longest"]),
        ]
    ):
        proto.graph.node.insert(at + i, node)
    for node in attention:
        node.input[5] = "as_longest"
    edited = tmp_path / "edited.onnx"
    onnx.save(proto, str(edited))
    spec = str(built.models / "llama_causal_lm.toml")
    code, out = _verify(edited, built.models, "--spec", spec, "--variant", VARIANT)
    assert code == 1, out
    ours = [line.split() for line in out.splitlines() if " onnxruntime[cpu] " in line]
    rows = {cells[2]: cells[4] for cells in ours if cells[2] in ("batch-1", "padded", "same-length")}
    assert rows == {"batch-1": "PASS", "padded": "FAIL", "same-length": "PASS"}, out
    assert "generate padded: step 2, row 1" in out, out  # the prompt's own rows are causal
    result = CliRunner().invoke(
        cli,
        ["localize", str(edited), "--spec", spec, "--variant", VARIANT, "--generate-step", "2", "--generate", "4",
         "--layout", "padded"],
    )  # fmt: skip
    assert result.exit_code == 2 and "laid out as the module's is not" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda t: t.replace('kwargs = { positions = "mask" }\n', "").replace(
                '[[inputs]]\nname = "past_key_values.0.key"',
                '[[inputs]]\nname = "position_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n'
                '[[inputs]]\nname = "past_key_values.0.key"',
                1,
            ),
            "would ignore 'position_ids'",
        ),
        (lambda t: t.replace('mask = "full"', 'mask = "left-padding"'), 'declare mask = "full"'),
        (
            lambda t: t.replace("transformers:LlamaConfig", "transformers:MistralConfig").replace(
                'attn_implementation = "sdpa"', 'attn_implementation = "sdpa", sliding_window = 16'
            ),
            "sliding_window = 16 is shorter than the 40 positions",
        ),
        (  # MistralConfig has no use_sliding_window: it keeps the key aside and applies its window
            lambda t: t.replace("transformers:LlamaConfig", "transformers:MistralConfig").replace(
                '"sdpa"', '"sdpa", sliding_window = 16, use_sliding_window = false'
            ),
            "sliding_window = 16 is shorter than the 40 positions",
        ),
        (  # MistralConfig's own window, which the spec leaves as it is
            lambda t: t.replace("transformers:LlamaConfig", "transformers:MistralConfig").replace(
                "max_seq = 40", "max_seq = 5000"
            ),
            "sliding_window = 4096 is shorter than the 5000 positions",
        ),
        (
            lambda t: t.replace(
                'name = "attention_mask"\ndtype = "int64"', 'name = "attention_mask"\ndtype = "float32"'
            ).replace('convention = "binary"', 'convention = "additive"'),
            "convention 'additive' does not mean",
        ),
        (  # before a 16 s export, not after it
            lambda t: t.replace('"past_seq", 16]', '"past_seq", 24]').replace('"total_seq", 16]', '"total_seq", 24]'),
            "gqa-rotary: the cache's heads are 24 wide",
        ),
    ],
    ids=["position_ids", "padding", "window", "window-kept", "class-window", "additive", "heads"],
)
def test_a_spec_whose_positions_the_graph_would_not_count_is_refused_in_one_line(
    tmp_path: Path, edit: object, says: str
) -> None:
    text = edit(_genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text()))  # type: ignore[operator]
    (spec,) = _write(tmp_path / "models", text)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["build", str(spec), "--out", str(out), "--variant", VARIANT])
    assert result.exit_code != 0, result.output
    failure = [line for line in result.output.splitlines() if "FAILED" in line]
    assert len(failure) == 1 and says in failure[0], result.output
    assert "traceback" not in result.output.lower()
    assert not (out / f"{NAME}.onnx").exists()


@pytest.mark.slow  # an export of the plain graph for the map and a localize: about 15 s
def test_a_key_column_fault_in_the_packed_projection_is_localized_at_k_proj(built: Built, tmp_path: Path) -> None:
    """The packed MatMul keeps its record: localize takes it apart and headlines the key's
    projection, at a case the spec's extend_batch lets the graph run (batch 1 on a filled cache)."""
    proto = onnx.load(str(built.out / f"{NAME}.onnx"))
    weight = next(t for t in proto.graph.initializer if t.name.endswith("qkv_weight"))
    packed = numpy_helper.to_array(weight).copy()
    packed[:, 32:48] *= 1.25  # the key's columns (after the query's 2 heads of 16)
    weight.CopyFrom(numpy_helper.from_array(packed, weight.name))
    headline, output = _localized(proto, built, tmp_path)
    assert "self_attn.k_proj" in headline and "batch=1" in output, output


def _localized(proto: onnx.ModelProto, made: Built, tmp_path: Path) -> tuple[str, str]:
    """``proto``, an edit of ``made``'s graph, localized with its spec: red, its DIVERGES line
    and the whole output."""
    edited = tmp_path / "edited.onnx"
    onnx.save(proto, str(edited))
    spec = made.models / "llama_causal_lm.toml"
    result = CliRunner().invoke(cli, ["localize", str(edited), "--spec", str(spec), "--variant", VARIANT])
    assert result.exit_code == 1, result.output
    return next(line for line in result.output.splitlines() if line.startswith("DIVERGES")), result.output


def test_a_fault_inside_groupqueryattention_is_localized_at_it_not_at_the_output_projection(
    built: Built, tmp_path: Path
) -> None:
    """The op hands its output straight to the output projection; it was named for no FX
    node, so its region had no PyTorch value and joined the projection's: a second layer's
    attention scale 5 % off was named at ``o_proj``. The output now takes the name of the
    merged heads' value, which PyTorch has."""
    proto = onnx.load(str(built.out / f"{NAME}.onnx"))
    second = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"][1]
    scale = next(a for a in second.attribute if a.name == "scale")
    scale.f *= 0.95
    headline, _ = _localized(proto, built, tmp_path)
    assert f"at ONNX {second.name} " in headline and "GroupQueryAttention]" in headline, headline
    assert "scaled_dot_product_attention" in headline and "o_proj" not in headline, headline


@pytest.mark.slow  # two more graphs built and verified: about 40 s
def test_its_int4_and_fp16_chains_verify_green(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The deploy forms: int4 after it for CPUs, fp16 for GPUs (GroupQueryAttention runs in
    float16 only there), each judged by its own simulated rounding and green."""
    text = _genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())
    chains = (f"{VARIANT}+int4", f"{VARIANT}+fp16")
    made = shared_build(tmp_path_factory, "gqa-rotary-lossy", lambda folder: _write(folder, text), variants=chains)
    assert made.errors == {f"llama_causal_lm.{c}": None for c in chains}, made.errors
    for chain in chains:
        proto = onnx.load(str(made.out / f"llama_causal_lm.{chain}.onnx"))
        assert Counter(n.op_type for n in proto.graph.node)["RotaryEmbedding"] == 0
    code, out = _verify(made.out, made.models)
    assert code == 0, out


@pytest.mark.slow  # a build and a verify: about 20 s
def test_a_bool_mask_is_counted_as_an_integer_one(tmp_path_factory: pytest.TempPathFactory) -> None:
    """ReduceSum takes no bool: the lengths are counted on the mask cast to int32 (the
    checker rejected the graph before)."""
    text = _genai_form((TINY_ZOO / "llama_causal_lm.toml").read_text())
    text = text.replace('name = "attention_mask"\ndtype = "int64"', 'name = "attention_mask"\ndtype = "bool"')
    text = text.replace('convention = "binary"', 'convention = "attend"')
    made = shared_build(tmp_path_factory, "gqa-rotary-bool", lambda folder: _write(folder, text), variants=(VARIANT,))
    assert made.errors == {NAME: None}, made.errors
    result = CliRunner().invoke(cli, ["verify", str(made.out), "--models", str(made.models), "--no-latency"])
    assert result.exit_code == 0, result.output
