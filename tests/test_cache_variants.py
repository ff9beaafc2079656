"""Variants with a cache: the opset-23 Attention op with past inputs and ONNX Runtime's
MultiHeadAttention / GroupQueryAttention with past, built from the zoo decoders and verified
over decode steps; where ONNX Runtime cannot run a declared size, the build says so."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from attn_export.build import BuildOptions, build_models
from attn_export.cli import cli
from attn_export.errors import ExportFailure
from attn_export.export.cache_in_op import fold_cache
from attn_export.export.variants import make_variant
from tests.conftest import ZOO, write_spec


def _one_stream(text: str) -> str:
    """The spec at batch 1 only: a single decoding stream, as on a CPU server."""
    assert "batch = { min = 1, max = 4 }\n" in text
    text = text.replace("batch = { min = 1, max = 4 }\n", "").replace('["batch", ', "[1, ")
    return text.replace('mask = "left-padding"\n', 'mask = "left-padding"\nlayout = "key-padding"\n')


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str | None]]:
    root = tmp_path_factory.mktemp("cache_variants")
    models = root / "models"
    gqa = (ZOO / "gqa_rope_kv_cache.toml").read_text()
    specs = [
        write_spec(models, "mha_kv_cache", (ZOO / "mha_kv_cache.toml").read_text()),
        write_spec(models, "gqa_rope_kv_cache", gqa),
        write_spec(models, "gqa_one_stream", _one_stream(gqa)),
    ]
    summary = build_models(specs, BuildOptions(root / "out", variants=("attention-op", "ort-past")))
    return root / "out", models, {r.name: r.error for r in summary.results}


def _graph(out: Path, key: str) -> onnx.ModelProto:
    return onnx.load(out / f"{key}.onnx")


def _cache_op(proto: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    (node,) = [n for n in proto.graph.node if n.op_type == op_type]
    return node


def test_the_attention_op_takes_the_cache_in(built) -> None:
    out, _, errors = built
    for model in ("mha_kv_cache", "gqa_rope_kv_cache"):
        assert errors[f"{model}.attention-op"] is None
        proto = _graph(out, f"{model}.attention-op")
        node = _cache_op(proto, "Attention")
        assert list(node.input[4:]) == ["past_key_values.0.key", "past_key_values.0.value"]
        assert list(node.output[1:]) == ["present.0.key", "present.0.value"]
        pasts = {"past_key_values.0.key", "past_key_values.0.value"}
        assert not [n for n in proto.graph.node if n.op_type == "Concat" and pasts & set(n.input)]


def test_onnx_runtime_cache_ops_take_the_cache_in(built) -> None:
    out, _, errors = built
    for key, op_type, past in (
        ("mha_kv_cache.ort-past", "MultiHeadAttention", (6, 8)),
        ("gqa_one_stream.ort-past", "GroupQueryAttention", (3, 5)),
    ):
        assert errors[key] is None
        node = _cache_op(_graph(out, key), op_type)
        assert node.domain == "com.microsoft"
        assert list(node.input[past[0] : past[1]]) == ["past_key_values.0.key", "past_key_values.0.value"]
        assert list(node.output[1:]) == ["present.0.key", "present.0.value"]


def test_cache_variants_pass_verify_over_decode_steps(built, monkeypatch: pytest.MonkeyPatch) -> None:
    out, models, _ = built
    monkeypatch.chdir(models.parent)
    names = ["mha_kv_cache.attention-op", "gqa_rope_kv_cache.attention-op"]
    names += ["mha_kv_cache.ort-past", "gqa_one_stream.ort-past"]
    files = [str(out / f"{name}.onnx") for name in names]
    result = CliRunner().invoke(cli, ["verify", *files, "--no-latency", "--decode", "3"])
    assert result.exit_code == 0, result.output
    # both scenarios for each batched model, batch 1 for the one-stream one
    assert "7 of 7 decode trajectories agree (up to 3 steps after the prompt)" in result.output


def test_group_query_attention_where_onnx_runtime_refuses_a_declared_size(built) -> None:
    _, _, errors = built
    error = errors["gqa_rope_kv_cache.ort-past"]
    assert error is not None
    assert "smoke check at" in error and "batch_size must be 1 when sequence_length > 1 and past context" in error


def _attention_graph(is_causal: int) -> onnx.ModelProto:
    """Attention over Concat(past, new) keys and values, as the opset-23 export writes it."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [1, 2, "s", 4]) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(n, f, [1, 2, "p", 4]) for n in ("past_k", "past_v")]
    nodes = [
        helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
        helper.make_node("Attention", ["q", "present_k", "present_v"], ["y"], is_causal=is_causal),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "present_k", "present_v")]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_a_causal_attention_op_keeps_its_concat() -> None:
    proto = _attention_graph(is_causal=1)
    assert fold_cache(proto) == []  # the op would align its causal mask differently with past inputs
    assert [n.op_type for n in proto.graph.node] == ["Concat", "Concat", "Attention"]
    with pytest.raises(ExportFailure, match="ort-past needs a decoder whose cache Concat"):
        make_variant("ort-past", proto)
    folded = fold_cache(_attention_graph(is_causal=0))
    assert [list(op.node.input) for op in folded] == [["q", "k", "v", "", "past_k", "past_v"]]
