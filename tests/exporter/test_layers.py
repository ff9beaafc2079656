"""Layers without wrappers: PyTorch's and Hugging Face's attention built from their spec
alone (config objects, forward keywords, rotary embeddings computed in the graph, outputs
picked from tuples and model-output objects), each verified against PyTorch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.exporter.factory import instantiate, resolve_object
from attn_export.exporter.torch_export import export_onnx
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.masks import EXPANSIONS
from attn_export.model_spec.shapes import example_sizes
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, verify_artifacts
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.torch_eager import TorchRuntime
from tests.conftest import TINY_ZOO, ZOO, needs_transformers, tiny_spec, write_spec

#: The new zoo models, what their exported graph gave on fully masked rows, and PyTorch's.
NEW_ZOO = [
    pytest.param("torch_mha", {"fully-padded-sequence": "NaN"}, id="torch_mha"),
    pytest.param(
        "bert_attention", {"fully-padded-sequence": "mean of V"}, id="bert_attention", marks=needs_transformers
    ),
    pytest.param(
        "llama_attention",
        {"fully-masked-row": "NaN", "fully-padded-sequence": "NaN"},
        id="llama_attention",
        marks=needs_transformers,
    ),
]


@pytest.mark.parametrize(("name", "was"), NEW_ZOO)
def test_new_zoo_model_builds_from_its_spec_alone_and_verifies(zoo_dir: Path, name: str, was: dict) -> None:
    entry = load_manifest(zoo_dir).models[name]
    spec = entry.model_spec
    assert spec.module.startswith(("torch.", "transformers")), "no user code"
    assert entry.variant_info["fully_masked"]["repair"] == {
        "rewrite": "zero",
        "softmax_nodes": 1,
        "gives": "0",
        "was": was,
    }
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, n_random=4)
    report = verify_artifacts(zoo_dir, load_manifest(zoo_dir), [name], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    named = [c for c in report.cases if c.shape in was]
    assert len(named) == len(was)
    assert all(c.notes == ["fully masked rows: torch[cpu] gives 0, onnxruntime[cpu] gives 0"] for c in named)


def test_repair_turns_nan_into_pytorchs_value(zoo_dir: Path) -> None:
    """nn.MultiheadAttention gives 0 where every key is padded (its safe softmax); the
    exported graph gives NaN there until build rewrites its Softmax."""
    entry = load_manifest(zoo_dir).models["torch_mha"]
    spec = entry.model_spec
    module = instantiate(spec)
    raw = export_onnx(module, spec, make_feeds(spec, example_sizes(spec), 0))  # as the exporter leaves it
    feeds = make_feeds(spec, example_sizes(spec), 1, case="fully-padded-sequence")
    with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims) as eager:
        expected = eager.run(feeds)["output"]
    with OnnxRuntime(raw.SerializeToString(), spec.inputs, spec.outputs, spec.dims) as before:
        nan = before.run(feeds)["output"]
    with OnnxRuntime(zoo_dir / entry.file, spec.inputs, spec.outputs, spec.dims) as after:
        repaired = after.run(feeds)["output"]
    assert np.isnan(nan[0]).all() and np.isfinite(nan[1:]).all()  # only the padded sequence
    assert (expected[0] == expected[0, :1]).all()  # no key attended: 0, then out_proj's bias on every row
    np.testing.assert_allclose(repaired, expected, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(nan[1:], expected[1:], atol=1e-5, rtol=1e-4)


@needs_transformers
def test_rotary_embeddings_are_computed_in_the_graph(zoo_dir: Path) -> None:
    graph = onnx.load(zoo_dir / "llama_attention.onnx").graph
    assert [i.name for i in graph.input] == ["hidden_states", "attention_mask"]
    assert {"Cos", "Sin"} <= {n.op_type for n in graph.node}


@needs_transformers
def test_the_spec_calls_llama_attention_as_llama_model_does() -> None:
    """Rotary embeddings of positions 0..seq-1 for every sequence, the mask by keyword,
    output 0 picked: what a hand-written wrapper would do."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    spec = load_spec(ZOO / "llama_attention.toml")
    wrapped = instantiate(spec)
    feeds = make_feeds(spec, {"batch": 3, "seq": 7}, 0)
    x, mask = (torch.from_numpy(feeds[t.name]) for t in spec.inputs)
    layer = wrapped.module
    positions = torch.arange(7).expand(3, 7)
    with torch.no_grad():
        want = layer(x, position_embeddings=LlamaRotaryEmbedding(layer.config)(x, positions), attention_mask=mask)[0]
        got = wrapped(x, mask)
    assert isinstance(got, tuple) and len(got) == 1
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


@needs_transformers
def test_a_fused_attention_is_repaired_like_a_softmax(tmp_path: Path) -> None:
    """ort-fused turns BertAttention into ONNX Runtime's MultiHeadAttention, which gives the
    mean of V on a padded sequence: build rewrites the fused op so it gives PyTorch's 0."""
    out = tmp_path / "out"
    result = build_models([TINY_ZOO / "bert_attention.toml"], BuildOptions(out, variants=("ort-fused",))).results[0]
    assert result.status == "built", result.error
    entry = load_manifest(out).models["bert_attention.ort-fused"]
    assert entry.variant_info["fully_masked"]["repair"] == {
        "rewrite": "zero",
        "softmax_nodes": 1,
        "gives": "0",
        "was": {"fully-padded-sequence": "mean of V"},
    }
    assert "com.microsoft.MultiHeadAttention" in entry.variant_info["ops"]
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, distributions=("normal",), n_random=0)
    report = verify_artifacts(out, load_manifest(out), ["bert_attention.ort-fused"], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    (padded,) = [c for c in report.cases if c.shape == "fully-padded-sequence"]
    assert padded.notes == ["fully masked rows: torch[cpu] gives 0, onnxruntime[cpu] gives 0"]


@pytest.mark.slow  # an opset-23 export and a verify (12 s); the graph change has its own fast test
def test_multihead_attention_with_a_key_padding_mask_builds_and_verifies_as_the_attention_op(tmp_path: Path) -> None:
    """nn.MultiheadAttention's padding mask reaches the Attention op as ``[batch, heads, 1, keys]``,
    which ONNX Runtime refuses. On the padded sequence the attention gives 0 on both sides
    (then out_proj's bias), which the rewrites of the Attention op tell."""
    out = tmp_path / "out"
    result = build_models([TINY_ZOO / "torch_mha.toml"], BuildOptions(out, variants=("attention-op",))).results[0]
    assert result.status == "built", result.error
    entry = load_manifest(out).models["torch_mha.attention-op"]
    assert entry.variant_info["mask_rows_expanded"] == 1
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, n_random=4)
    report = verify_artifacts(out, load_manifest(out), ["torch_mha.attention-op"], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    (padded,) = [c for c in report.cases if c.shape == "fully-padded-sequence"]
    assert padded.passed
    assert padded.notes == ["fully masked rows: torch[cpu] gives 0, onnxruntime[cpu] gives 0"]


@pytest.mark.slow  # three Hugging Face exports (35 s); the graph changes have their own fast tests
@needs_transformers
def test_hugging_face_layers_build_their_variants_and_verify(tmp_path: Path) -> None:
    """Llama's fused graph writes ONNX Runtime's SimplifiedLayerNormalization in the ONNX
    domain, which ONNX Runtime runs; BERT's float16 graph masks at float16's lowest, which
    the fully masked row test still finds; Llama's fused attention gives NaN on a fully
    masked row until build rewrites the fused op."""
    cases = [("llama_sdpa_kv_cache", "ort-fused"), ("bert_attention", "fp16"), ("llama_attention", "ort-fused")]
    for name, variant in cases:
        result = build_models([TINY_ZOO / f"{name}.toml"], BuildOptions(tmp_path / "out", variants=(variant,)))
        assert result.results[0].status == "built", result.results[0].error
    manifest = load_manifest(tmp_path / "out")
    repair = manifest.models["llama_attention.ort-fused"].variant_info["fully_masked"]["repair"]
    assert repair["was"] == {"fully-masked-row": "NaN", "fully-padded-sequence": "NaN"} and repair["gives"] == "0"
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, distributions=("normal",), decode_steps=2)
    keys = [f"{name}.{variant}" for name, variant in cases]
    report = verify_artifacts(tmp_path / "out", manifest, keys, options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    named = [c for c in report.cases if c.shape.startswith("fully-") and not c.model.startswith("llama_sdpa")]
    assert len(named) == 3
    assert all(c.notes == ["fully masked rows: torch[cpu] gives 0, onnxruntime[cpu] gives 0"] for c in named)


@pytest.mark.slow  # a Hugging Face decoder's export and verify (20 s)
@needs_transformers
def test_a_float16_decoder_is_repaired_before_its_smoke_check(tmp_path: Path) -> None:
    """LlamaModel's float16 graph masks at -65504, so a left-padded row's scores round apart and
    its weights are not uniform, as PyTorch's are: the graph differs only there. Build repairs
    it before the smoke check, which then passes, where it used to fail the build."""
    out = tmp_path / "out"
    result = build_models([TINY_ZOO / "llama_model_kv_cache.toml"], BuildOptions(out, variants=("fp16",))).results[0]
    assert result.status == "built", result.error
    manifest = load_manifest(out)
    repair = manifest.models["llama_model_kv_cache.fp16"].variant_info["fully_masked"]["repair"]
    assert repair["rewrite"] == "uniform" and repair["was"] == {"fully-padded-sequence": "other"}
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, distributions=("normal",), decode_steps=2)
    report = verify_artifacts(out, manifest, ["llama_model_kv_cache.fp16"], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]


@pytest.mark.slow  # a Hugging Face decoder's two exports and a verify (30 s)
@needs_transformers
def test_a_variant_with_nothing_to_rewrite_is_labelled_by_the_plain_export(tmp_path: Path) -> None:
    """The Llama sdpa decoder's Attention op has a boolean mask, which no rewrite takes: what
    PyTorch and the graph give on a padded sequence is told by the plain export's rewrites,
    in build (the export in hand) and in verify (the plain graph in the same folder)."""
    out = tmp_path / "out"
    options = BuildOptions(out, variants=("fp32", "attention-op"))
    results = build_models([TINY_ZOO / "llama_sdpa_kv_cache.toml"], options).results
    assert all(r.status == "built" for r in results), [r.error for r in results]
    manifest = load_manifest(out)
    gives = manifest.models["llama_sdpa_kv_cache.attention-op"].variant_info["fully_masked"]["cases"]
    assert gives == {"fully-padded-sequence": {"torch": "0", "onnxruntime": "0"}}
    options = VerifyOptions(models_dir=TINY_ZOO, latency=False, distributions=("normal",), decode_steps=0)
    report = verify_artifacts(out, manifest, ["llama_sdpa_kv_cache.attention-op"], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    (padded,) = [c for c in report.cases if c.shape == "fully-padded-sequence"]
    assert padded.notes == ["fully masked rows: torch[cpu] gives 0, onnxruntime[cpu] gives 0"]


LLAMA_MODEL = """
module = "transformers:LlamaModel"
call = { use_cache = false }

[config]
class = "transformers:LlamaConfig"
hidden_size = 32
num_attention_heads = 4
num_key_value_heads = 2
intermediate_size = 64
num_hidden_layers = 1
vocab_size = 16
attn_implementation = "sdpa"

[[inputs]]
name = "inputs_embeds"
shape = ["batch", "seq", 32]
arg = "inputs_embeds"
[[inputs]]
name = "attention_mask"
dtype = "int64"
shape = ["batch", "seq"]
mask = "padding"
convention = "binary"
arg = "attention_mask"

[[outputs]]
name = "last_hidden_state"
shape = ["batch", "seq", 32]
pick = "last_hidden_state"

[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 32 }
"""


@pytest.mark.slow  # a whole Hugging Face model export (9 s); make test runs the single layers
@needs_transformers
def test_one_layer_llama_model_with_an_integer_mask_and_an_output_picked_by_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = build_models([write_spec(tmp_path / "models", "llama_model", LLAMA_MODEL)], BuildOptions(out))
    assert summary.results[0].status == "built", summary.results[0].error
    options = VerifyOptions(models_dir=tmp_path / "models", latency=False)
    report = verify_artifacts(out, load_manifest(out), ["llama_model"], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]


def test_a_tuple_without_pick_says_how_to_pick(tmp_path: Path) -> None:
    text = (TINY_ZOO / "torch_mha.toml").read_text().replace("pick = 0\n", "")
    result = build_models([write_spec(tmp_path, "torch_mha", text)], BuildOptions(tmp_path / "out")).results[0]
    assert result.status == "failed"
    assert "module returned 2 outputs, spec declares 1 (choose with pick = <index or name> in each [[outputs]])" in (
        result.error or ""
    )


def test_a_factory_function_and_a_missing_pick_name(tmp_path: Path) -> None:
    text = (
        (TINY_ZOO / "torch_mha.toml")
        .read_text()
        .replace('module = "torch.nn:MultiheadAttention"', 'module = "tests.user_modules:make_mha"')
    )
    built = build_models([write_spec(tmp_path / "m", "torch_mha", text)], BuildOptions(tmp_path / "out")).results[0]
    assert built.status == "built", built.error
    wrong = text.replace("pick = 0", 'pick = "attn_output"')
    result = build_models([write_spec(tmp_path / "w", "torch_mha", wrong)], BuildOptions(tmp_path / "out2")).results[0]
    assert "pick = 'attn_output': the module returned a tuple with no names" in (result.error or "")


KEYS = '[[inputs]]\nname = "keys"\nshape = ["batch", "kv_seq", 16]\n'
VALUES = '[[inputs]]\nname = "values"\nshape = ["batch", "kv_seq", 16]\n'


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            lambda text: text.replace(KEYS + VALUES, VALUES + KEYS),
            "input 'values' is listed 2nd, so it is passed as forward's parameter 'keys', but forward takes "
            "'values' 3rd: list the inputs in forward's order, or set arg = \"values\" on it",
        ),
        (
            lambda text: text.replace(VALUES, ""),
            "MultiHeadAttention.forward(query, keys, values) does not take the spec's inputs, passed as query, "
            "keys in order: missing a required argument: 'values'",
        ),
    ],
    ids=["out of order", "missing"],
)
def test_inputs_that_do_not_fit_forward_exit_2_before_the_export(
    tmp_path: Path, edit: Callable[[str], str], said: str
) -> None:
    """Inputs bind to forward's parameters in the spec's order: one missing or out of order
    used to fail deep in the export naming another input, or to build a graph whose named
    inputs lie (keys and values swapped give the same numbers on both sides)."""
    text = tiny_spec(tmp_path / "models").read_text()
    spec = write_spec(tmp_path / "bad", "tiny", edit(text))
    assert spec.read_text() != text
    result = CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"[module] tiny: {said}" in result.output


def test_missing_transformers_exits_2_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    result = CliRunner().invoke(cli, ["build", "bert_attention", "--models", str(ZOO), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert (
        "[module] bert_attention (transformers:BertConfig) needs transformers, which is not installed "
        "(pip install 'attn-export[hf]')"
    ) in result.output


#: Attention layers given the tokenizer's mask: the adapter expands it as BertModel and
#: LlamaModel do before calling their layers.
TOKENIZER_MASK = """
module = "transformers.models.{family}.modeling_{family}:{layer}"
kwargs = {{ layer_idx = 0 }}
{call}
[config]
class = "transformers:{config}"
hidden_size = 32
num_attention_heads = 4
intermediate_size = 64
attn_implementation = "{attn}"

[[inputs]]
name = "hidden_states"
shape = ["batch", "seq", 32]
[[inputs]]
name = "attention_mask"
dtype = "int64"
shape = ["batch", "seq"]
mask = "{pattern}"
convention = "binary"
arg = "attention_mask"
expand = "{expand}"

[[outputs]]
name = "output"
shape = ["batch", "seq", 32]
pick = 0

[dims]
batch = {{ min = 1, max = 3 }}
seq = {{ min = 1, max = 12 }}
"""
ROTARY = """
[call.position_embeddings]
rotary = "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding"
positions_of = "hidden_states"
"""
EXPANDED = {
    "bert_tokenizer_mask": {"family": "bert", "layer": "BertAttention", "config": "BertConfig", "attn": "sdpa",
                            "pattern": "padding", "expand": "bidirectional", "call": ""},
    "llama_tokenizer_mask": {"family": "llama", "layer": "LlamaAttention", "config": "LlamaConfig", "attn": "eager",
                             "pattern": "left-padding", "expand": "causal", "call": ROTARY},
}  # fmt: skip


@needs_transformers
@pytest.mark.slow  # two Hugging Face exports; make test runs the other layers
@pytest.mark.parametrize("name", ["llama_tokenizer_mask", "bert_tokenizer_mask"])
def test_a_layer_given_the_tokenizers_mask_gets_it_expanded_as_its_model_class_does(tmp_path: Path, name: str) -> None:
    import torch

    models, out = tmp_path / "models", tmp_path / "out"
    path = write_spec(models, name, TOKENIZER_MASK.format(**EXPANDED[name]))
    summary = build_models([path], BuildOptions(out))
    assert summary.results[0].status == "built", summary.results[0].error
    graph = onnx.load(out / f"{name}.onnx").graph
    assert [(i.name, i.type.tensor_type.elem_type) for i in graph.input] == [
        ("hidden_states", onnx.TensorProto.FLOAT),
        ("attention_mask", onnx.TensorProto.INT64),  # the tokenizer's mask is the graph's input
    ]
    options = VerifyOptions(models_dir=models, latency=False, n_random=0)
    report = verify_artifacts(out, load_manifest(out), [name], options)
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]

    spec = load_spec(path)
    wrapped = instantiate(spec)
    feeds = make_feeds(spec, {"batch": 2, "seq": 6}, 0)
    x, mask = (torch.from_numpy(feeds[t.name]) for t in spec.inputs)
    layer = wrapped.module
    expand = resolve_object(spec, EXPANSIONS[EXPANDED[name]["expand"]])
    with torch.no_grad():
        four_d = expand(config=wrapped.config, inputs_embeds=x, attention_mask=mask, past_key_values=None)
        rotary = dict(wrapped.rotary.items()).get("position_embeddings")
        extra = {"position_embeddings": rotary(x, torch.arange(6).expand(2, 6))} if rotary else {}
        want = layer(x, attention_mask=four_d, **extra)[0]
        torch.testing.assert_close(wrapped(x, mask)[0], want, rtol=0, atol=0)  # as the model class calls the layer
