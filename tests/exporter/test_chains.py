"""Chained variants (``ort-past+int8``): each link made from the graph of the one before,
recorded link by link in the manifest, verified at the composed tolerance; a link that does
nothing on the graph it follows is refused by the build, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.errors import ExportFailure
from attn_export.exporter.variants import make_variant, op_counts
from attn_export.model_spec import load_spec
from tests.conftest import TINY_ZOO, Built, copy_build, plant

DECODER = "mha_kv_cache"
CHAINS = ("ort-past+int8", "attention-op+fp16")


def _graph(built: Built, variant: str) -> onnx.ModelProto:
    return onnx.load(built.out / f"{DECODER}.{variant}.onnx")


@pytest.mark.slow  # the cache variants' build (35-50 s); CI runs it
def test_a_chained_graph_holds_every_link_s_transform(cache_build: Built) -> None:
    assert {k: v for k, v in cache_build.errors.items() if k.startswith(DECODER)} == dict.fromkeys(
        [f"{DECODER}.{v}" for v in ("attention-op", "ort-past", *CHAINS)]
    )
    quantized = op_counts(_graph(cache_build, "ort-past+int8"))
    assert quantized["com.microsoft.MultiHeadAttention"] == 1  # ort-past's cache op ...
    assert quantized["MatMulInteger"] == 4 and quantized["DynamicQuantizeLinear"] > 0  # ... and int8's MatMuls
    assert quantized["MatMul"] == 0
    half = _graph(cache_build, "attention-op+fp16")
    attention = [n for n in half.graph.node if n.op_type == "Attention"]
    assert len(attention) == 1 and len(attention[0].input) == 6  # the op with the cache in it ...
    weights = {t.data_type for t in half.graph.initializer if t.dims}
    assert onnx.TensorProto.FLOAT16 in weights and onnx.TensorProto.FLOAT not in weights  # ... in float16


@pytest.mark.slow  # the cache variants' build (35-50 s); CI runs it
def test_the_manifest_records_each_link(cache_build: Built) -> None:
    models = load_manifest(cache_build.out).models
    entry = models[f"{DECODER}.ort-past+int8"]
    assert entry.variant == "ort-past+int8" and entry.file == f"{DECODER}.ort-past+int8.onnx"
    links = entry.variant_info["links"]
    assert [link["variant"] for link in links] == ["ort-past", "int8"]
    assert links[0]["info"]["cache_ops"] == ["MultiHeadAttention"]
    assert links[1]["info"]["ops"]["MatMulInteger"] == 4
    assert entry.build_key != models[f"{DECODER}.ort-past"].build_key
    half = models[f"{DECODER}.attention-op+fp16"].variant_info["links"]
    assert [link["variant"] for link in half] == ["attention-op", "fp16"] and half[0]["info"]["cache_in_op"] == 1


@pytest.mark.slow  # the cache variants' build (35-50 s); CI runs it
def test_chains_pass_verify_and_decode_at_the_composed_tolerance(cache_build: Built, tmp_path: Path) -> None:
    files = [str(cache_build.out / f"{DECODER}.{v}.onnx") for v in CHAINS]
    report = tmp_path / "report.json"
    args = ["verify", *files, "--models", str(cache_build.models), "--no-latency", "--distribution", "normal"]
    result = CliRunner().invoke(cli, [*args, "--decode", "2", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "4 of 4 decode trajectories agree (up to 2 steps after the prompt)" in result.output
    spec = load_spec(cache_build.models / f"{DECODER}.toml")
    cases = json.loads(report.read_text())["cases"]
    for variant in CHAINS:
        rows = [c for c in cases if c["model"] == f"{DECODER}.{variant}"]
        composed = spec.tolerances(variant)
        assert rows and all(c["passed"] for c in rows)
        for c in (c for row in rows for c in row["comparisons"]):
            assert c["rtol"] == composed[c["name"]].rtol  # atol is widened by the float32 floor
            assert c["atol"] >= composed[c["name"]].atol
        # a real error, beyond the model's own tolerance: only the composed one passes it
        assert max(c["min_passing_atol"] for row in rows for c in row["comparisons"]) > spec.tolerance.atol * 10
        # a lossy chain is judged, case by case and step by step, by what its rounding does to the module
        decode = [d for d in json.loads(report.read_text())["decode"] if d["model"] == f"{DECODER}.{variant}"]
        compared = [c for row in rows for c in row["comparisons"]]
        compared += [c for d in decode for step in d["steps"] for c in step["comparisons"]]
        rounded = [c["rounding_max"] > 0 for c in compared]
        assert decode and all(rounded)


def test_links_are_made_one_after_the_other_each_on_its_own_copy(zoo_dir: Path) -> None:
    source = onnx.load(zoo_dir / "mha_cross.onnx")
    before = source.SerializeToString(deterministic=True)
    chained = make_variant("int8+ort-optimized", source)
    by_hand = make_variant("ort-optimized", make_variant("int8", source).proto)
    assert chained.proto.SerializeToString(deterministic=True) == by_hand.proto.SerializeToString(deterministic=True)
    assert source.SerializeToString(deterministic=True) == before
    assert [link["variant"] for link in chained.info["links"]] == ["int8", "ort-optimized"]


def test_a_link_that_leaves_the_graph_as_it_was_cannot_follow(zoo_dir: Path) -> None:
    """The SDPA module has no weights: after ort-fused, int8 finds no MatMul weight to
    quantize, and the chain would be ort-fused under another name."""
    source = onnx.load(zoo_dir / "sdpa.onnx")
    assert make_variant("ort-fused", source).proto.graph.node
    with pytest.raises(ExportFailure) as refused:
        make_variant("ort-fused+int8", source)
    leaves = "it leaves ort-fused's graph as it was (ops, attributes, types)"
    assert str(refused.value) == f"int8 cannot follow ort-fused: {leaves}"


def test_a_lone_variant_that_leaves_the_graph_as_it_was_says_so(zoo_dir: Path) -> None:
    """int8 of the SDPA module (no weights) is the plain graph: bench timed it as an int8 row
    with nothing said; it is recorded, and bench says its row times the plain graph."""
    from attn_export.pipelines.bench.results import BenchReport
    from attn_export.report.bench_text import format_bench_summary

    made = make_variant("int8", onnx.load(zoo_dir / "sdpa.onnx"))
    said = "int8 left the graph as it was (ops, attributes, types): it computes as the plain export"
    assert made.info["unchanged"] == said and made.warnings == [said]
    peak = {"peak": 1.0, "torch": 1.0, "onnxruntime": 1.0}
    report = BenchReport("m", {}, 1, "cpu", peak, graph_notes={"sdpa ort:int8": f"times the plain graph: {said}"})
    assert f"sdpa ort:int8 times the plain graph: {said}" in format_bench_summary(report)
    assert BenchReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert "unchanged" not in make_variant("int8", onnx.load(zoo_dir / "mha.onnx")).info


@pytest.mark.slow
def test_the_build_names_the_link_that_did_nothing(tmp_path: Path) -> None:
    args = ["build", "sdpa", "--models", str(TINY_ZOO), "--out", str(tmp_path), "--variant", "ort-fused+int8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    leaves = "it leaves ort-fused's graph as it was (ops, attributes, types)"
    assert f"sdpa.ort-fused+int8: int8 cannot follow ort-fused: {leaves}" in result.output
    assert not (tmp_path / "sdpa.ort-fused+int8.onnx").exists()


@pytest.mark.slow
def test_bench_times_a_chain_like_any_variant(cache_build: Built, tmp_path: Path) -> None:
    copy = copy_build(cache_build, tmp_path)  # bench takes the folder's lock: never the shared one
    spec = str(copy.models / f"{DECODER}.toml")
    args = ["bench", spec, "--decode", "--past", "4", "--out", str(copy.out), "--variant", "ort-past+int8"]
    result = CliRunner().invoke(cli, [*args, "--budget", "0.01", "--no-memory", "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {r["runner"] for r in rows} == {"torch-eager", "ort:ort-past+int8"}
    lines = result.output.splitlines()
    batch_ends = next(line for line in lines if line.startswith("MODEL")).index("BATCH") + len("BATCH")
    table = [line for line in lines if line.startswith(DECODER)]
    assert len(table) == 2 and all(line[:batch_ends].endswith(" 1") for line in table), "columns out of line"


@pytest.mark.slow  # the cache variants' build (35-50 s); CI runs it
def test_an_fp16_attention_op_without_float32_softmax_is_red(cache_build: Built, tmp_path: Path) -> None:
    """The opset-23 Attention op's softmax runs in its inputs' float16 unless softmax_precision says
    float32; ONNX Runtime's CPU shows no difference, so verify reads the graph."""
    copy = copy_build(cache_build, tmp_path)
    name = f"{DECODER}.attention-op+fp16"
    proto = onnx.load(copy.out / f"{name}.onnx")
    attention = next(n for n in proto.graph.node if n.op_type == "Attention")
    assert [a.i for a in attention.attribute if a.name == "softmax_precision"] == [onnx.TensorProto.FLOAT]
    kept = [a for a in attention.attribute if a.name != "softmax_precision"]
    del attention.attribute[:]
    attention.attribute.extend(kept)
    plant(copy.out, name, proto)
    args = ["verify", str(copy.out / f"{name}.onnx"), "--models", str(copy.models), "--no-latency", "--decode", "0"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    said = f"Attention node '{attention.name}' computes its softmax in float16 (softmax_precision None)"
    assert said in result.output
