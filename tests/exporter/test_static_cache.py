"""static-cache: the tiny KV-cache decoder at batch 1 with its cache a buffer of max_seq
positions written in place, verified over decode steps with its unfilled slots poisoned,
and decoded bound, past and present one buffer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from attn_export.cli import cli
from attn_export.errors import ArtifactError, RuntimeFailure, SpecError
from attn_export.exporter.factory import instantiate
from attn_export.model_spec import ModelSpec, load_spec
from attn_export.model_spec.cache import cache_of
from attn_export.pipelines.bench.physics import graph_weight_bytes, module_weight_bytes
from attn_export.runtimes.decoders import DecodeWindow, OrtDecoder
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.static_cache import METADATA_KEY, StaticCache
from tests.conftest import TINY_ZOO, copy_build, endless_loop, needs_transformers, plant, shared_build, write_spec

CAPACITY = "\n[cache]\nmax_seq = 48\n"


def _one_stream(text: str) -> str:
    """The tiny decoder at batch 1: GroupQueryAttention takes several new tokens on a
    non-empty cache only there."""
    text = text.replace("batch = { min = 1, max = 4 }\n", "").replace('["batch", ', "[1, ")
    return text.replace('mask = "left-padding"\n', 'mask = "left-padding"\nlayout = "key-padding"\n') + CAPACITY


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    def specs(models: Path) -> list[Path]:
        return [write_spec(models, "mha_one_stream", _one_stream((TINY_ZOO / "mha_kv_cache.toml").read_text()))]

    variants = ("static-cache", "static-cache+int8", "static-cache+int4")
    built = shared_build(tmp_path_factory, "static-cache", specs, variants=variants)
    assert all(built.errors[f"mha_one_stream.{v}"] is None for v in variants), built.errors
    return built


def test_the_capacity_must_hold_the_longest_present(tmp_path: Path) -> None:
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text()
    with pytest.raises(SpecError, match=r"max_seq = 39 cannot hold a present of 40 positions \('past_seq' max 24"):
        load_spec(write_spec(tmp_path, "short", text + "\n[cache]\nmax_seq = 39\n"))
    assert cache_of(load_spec(write_spec(tmp_path, "fits", text + "\n[cache]\nmax_seq = 40\n"))).max_seq == 40
    with pytest.raises(SpecError, match=r"max_seq needs a past_key_values"):
        load_spec(write_spec(tmp_path, "none", (TINY_ZOO / "mha.toml").read_text() + CAPACITY))


def test_a_static_cache_needs_a_declared_capacity(tmp_path: Path) -> None:
    from attn_export.pipelines.building import BuildOptions, build_models

    spec = write_spec(
        tmp_path, "undeclared", _one_stream((TINY_ZOO / "mha_kv_cache.toml").read_text()).replace(CAPACITY, "")
    )
    summary = build_models([spec], BuildOptions(tmp_path / "out", variants=("static-cache",)))
    (result,) = [r for r in summary.results if r.name == "undeclared.static-cache"]
    assert result.error is not None and "declare [cache] max_seq in the spec" in result.error
    assert result.stages["spec"] is False and result.stages["export"] is None  # refused before the export
    assert summary.exit_code == 2  # the spec's fault, as the README's exit codes say


def test_the_graph_takes_buffers_and_a_length(built) -> None:
    proto = onnx.load(built.out / "mha_one_stream.static-cache.onnx")
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert shapes["past_key_values.0.key"] == [1, 4, "max_seq", 8] and shapes["past_length"] == []
    (node,) = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert list(node.input[3:5]) == ["past_key_values.0.key", "past_key_values.0.value"]
    assert list(node.output[1:]) == ["present.0.key", "present.0.value"]
    # the three projections as one MatMul, which the op reads packed
    assert list(node.input[1:3]) == ["", ""] and [n.op_type for n in proto.graph.node].count("MatMul") == 2
    # the export's read of the past's length is the filled length, one node a step
    filled = [n for n in proto.graph.node if "/filled/" in n.name]
    assert [(n.op_type, list(n.input)) for n in filled] == [("Reshape", ["past_length", filled[0].input[1]])]


def _verify(out: Path, models: Path, monkeypatch: pytest.MonkeyPatch, variant: str = "static-cache") -> str:
    monkeypatch.chdir(models.parent)
    graph = str(out / f"mha_one_stream.{variant}.onnx")
    result = CliRunner().invoke(cli, ["verify", graph, "--no-latency", "--decode", "3", "--distribution", "normal"])
    return f"{result.exit_code}\n{result.output}"


@pytest.mark.parametrize("variant", ["static-cache", "static-cache+int8"])
def test_verify_decodes_it_against_the_growing_cache(built, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    output = _verify(built.out, built.models, monkeypatch, variant)
    assert output.startswith("0\n"), output
    assert "1 of 1 decode trajectories agree (up to 3 steps after the prompt)" in output


def test_the_int8_chain_keeps_the_buffers_and_quantizes_the_projections(built) -> None:
    proto = onnx.load(built.out / "mha_one_stream.static-cache+int8.onnx")
    ops = [n.op_type for n in proto.graph.node]
    # the packed query, key and value projection and the output projection
    assert ops.count("GroupQueryAttention") == 1 and ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert shapes["past_key_values.0.key"] == [1, 4, "max_seq", 8] and shapes["past_length"] == []


@pytest.mark.slow
def test_bench_decode_times_it_in_place(built, tmp_path: Path) -> None:
    """bench --decode on the batch-1 decoder: the in-place rows say their presents came back
    at the buffer's address every step, and count only the new token as written."""
    import json

    copy = copy_build(built, tmp_path)
    spec = str(copy.models / "mha_one_stream.toml")
    args = ["bench", spec, "--decode", "--out", str(copy.out), "--past", "8", "--budget", "0.01", "--threads", "1"]
    args += [
        "--variant",
        "static-cache",
        "--variant",
        "static-cache+int8",
        "--no-memory",
        "--json",
        str(tmp_path / "d.json"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = {r["runner"]: r for r in json.loads((tmp_path / "d.json").read_text())["rows"]}
    assert rows["ort:static-cache"]["shared_buffer"] is True and rows["ort:static-cache+int8"]["shared_buffer"] is True
    assert rows["torch-eager"]["shared_buffer"] is None
    position = 2 * 4 * 8 * 4  # key and value: heads x head_dim x float32
    read = (8 + 3.5) * position  # the window's 8 steps read pasts of 8 .. 15 positions
    weights = graph_weight_bytes(copy.out / "mha_one_stream.static-cache.onnx")
    assert rows["ort:static-cache"]["bytes_per_token"] == pytest.approx(weights + read + position, abs=1)
    eager = module_weight_bytes(instantiate(load_spec(copy.models / "mha_one_stream.toml")))
    assert rows["torch-eager"]["bytes_per_token"] == pytest.approx(eager + read + read + position, abs=1)


def test_a_graph_reading_unfilled_slots_fails_naming_the_step(built, tmp_path, monkeypatch) -> None:
    """Planted: GroupQueryAttention told that every position of the buffer is filled
    (seqlens_k = max_seq - 1); the NaN poisoning the unfilled slots shows from the prompt on,
    since verify runs the graph as it is deployed, past and present one buffer (with
    separate buffers ONNX Runtime copies only the filled past, and the fault first showed at
    step 2)."""
    copy = copy_build(built, tmp_path)
    proto = onnx.load(copy.out / "mha_one_stream.static-cache.onnx")
    (expand,) = [n for n in proto.graph.node if n.output[0].endswith("/seqlens_k")]
    nodes = [
        helper.make_node("Shape", ["past_key_values.0.key"], ["planted/capacity"], start=2, end=3),
        helper.make_node("Cast", ["planted/capacity"], ["planted/capacity_i32"], to=onnx.TensorProto.INT32),
        helper.make_node("Sub", ["planted/capacity_i32", expand.input[0].rsplit("/", 1)[0] + "/one"], ["planted/last"]),
    ]
    expand.input[0] = "planted/last"
    for i, node in enumerate(nodes):
        proto.graph.node.insert(i, node)
    plant(copy.out, "mha_one_stream.static-cache", proto)
    output = _verify(copy.out, copy.models, monkeypatch)
    assert output.startswith("1\n"), output
    assert "decode batch-1: first divergence at step 1 (past 0, seq 2): output: 64 NaN/Inf" in output, output
    assert "FAIL mha_one_stream.static-cache onnxruntime[cpu] min normal (seed 0): output: 32 NaN/Inf" in output


def test_a_buffer_that_grows_past_its_capacity_fails_naming_the_step(built, tmp_path, monkeypatch) -> None:
    """Planted: each present comes back one position longer than its buffer (its first
    position again at the end): the filled positions are still right, the capacity is not."""
    copy = copy_build(built, tmp_path)
    proto = onnx.load(copy.out / "mha_one_stream.static-cache.onnx")
    (gqa,) = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    gqa.output[1] = "planted/present"
    one = helper.make_tensor("planted/one", onnx.TensorProto.INT64, [1], [1])
    zero = helper.make_tensor("planted/zero", onnx.TensorProto.INT64, [1], [0])
    two = helper.make_tensor("planted/two", onnx.TensorProto.INT64, [1], [2])
    proto.graph.initializer.extend([one, zero, two])
    proto.graph.node.extend(
        [
            helper.make_node(
                "Slice", ["planted/present", *(f"planted/{n}" for n in ("zero", "one", "two"))], ["planted/row"]
            ),
            helper.make_node("Concat", ["planted/present", "planted/row"], ["present.0.key"], axis=2),
        ]
    )
    plant(copy.out, "mha_one_stream.static-cache", proto)
    output = _verify(copy.out, copy.models, monkeypatch)
    assert output.startswith("1\n"), output
    assert (
        "decode batch-1: first divergence at step 1 (past 0, seq 2): step 1: onnxruntime[cpu]: present "
        "'present.0.key' came back [1, 4, 49, 8], not its buffer [1, 4, 48, 8]: a cache updated in place stays "
        "at its capacity of 48 positions"
    ) in output, output


def test_bound_decoding_writes_into_the_one_buffer(built) -> None:
    spec = load_spec(built.models / "mha_one_stream.toml")
    cache = cache_of(spec)
    plan = _window(spec)
    pasts, feeds, steps = plan.pasts, plan.steps, len(plan.steps)
    with OnnxRuntime(
        built.out / "mha_one_stream.static-cache.onnx",
        spec.inputs,
        spec.outputs,
        spec.dims,
        capacity=spec.cache_max_seq,
    ) as runtime:
        decoder = runtime.decoder(plan)
        assert isinstance(decoder, OrtDecoder)
        with pytest.raises(RuntimeFailure, match="after a step"):
            decoder.outputs()  # nothing stepped: no values to read, rather than stale ones
        grown = dict(pasts)
        for k in range(steps):
            decoder.step()
            want = runtime.run({**feeds[k], **grown})
            grown = {p: want[q] for p, q in cache.pairs}
        got = decoder.outputs()
        # every step's present came back at its buffer's address, its new positions written there
        assert decoder.shares_buffers() is True
    for name, value in want.items():
        assert got[name].shape == value.shape
        np.testing.assert_allclose(got[name], value, atol=1e-6)


def _window(spec: ModelSpec, past: int = 5, steps: int = 3) -> DecodeWindow:
    cache = cache_of(spec)
    rng = np.random.default_rng(0)
    pasts = {p: rng.standard_normal((1, 4, past, 8)).astype(np.float32) for p, _ in cache.pairs}
    x = rng.standard_normal((1, 1, 32)).astype(np.float32)
    feeds = [{"hidden_states": x, "attention_mask": np.ones((1, past + k + 1), np.int64)} for k in range(steps)]
    return DecodeWindow(cache, past, pasts, feeds)


def test_a_buffer_the_step_never_writes_is_not_shared(built) -> None:
    """The proof runs the window: a present that is its past passed through (the new token's
    key never written, its positions still NaN) fails it, even where the graph's structure
    were taken to say otherwise."""
    spec = load_spec(built.models / "mha_one_stream.toml")
    proto = onnx.load(built.out / "mha_one_stream.static-cache.onnx")
    (node,) = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    node.output[1] = "planted/key"
    proto.graph.node.append(helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]))
    with OnnxRuntime(
        proto.SerializeToString(), spec.inputs, spec.outputs, spec.dims, capacity=spec.cache_max_seq
    ) as runtime:
        decoder = runtime.decoder(_window(spec))
        assert isinstance(decoder, OrtDecoder) and decoder.shares_buffers() is False  # read from the graph
        decoder.shared = True  # as if it were written there: the steps say it is not
        assert decoder.shares_buffers() is False


def test_a_present_copied_after_the_attention_is_not_written_in_place(built) -> None:
    """SHARED is read from the graph: a present that another node produces (here an Identity
    after GroupQueryAttention) is a copy into the bound buffer, not the buffer written in place."""
    from attn_export.runtimes.static_cache import StaticCache

    proto = onnx.load(built.out / "mha_one_stream.static-cache.onnx")
    static = StaticCache.from_metadata({p.key: p.value for p in proto.metadata_props})
    assert static is not None and static.in_place(proto)
    (node,) = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    node.output[1] = "planted/key"
    proto.graph.node.append(helper.make_node("Identity", ["planted/key"], ["present.0.key"]))
    assert not static.in_place(proto)


def test_a_fault_in_one_packed_projection_is_localized_to_that_projection(built, tmp_path, monkeypatch) -> None:
    """Planted: the key's columns of the packed projection 5 % off. The graph holds one
    MatMul for the three; localization takes it apart again and names the key's projection
    and its source line, not the attention the packed MatMul feeds, and runs the whole
    graph with its cache in buffers, as verify does."""
    from onnx import numpy_helper

    copy = copy_build(built, tmp_path)
    proto = onnx.load(copy.out / "mha_one_stream.static-cache.onnx")
    (weight,) = [t for t in proto.graph.initializer if t.name.endswith("/qkv_weight")]
    packed = numpy_helper.to_array(weight).copy()
    query = packed.shape[1] // 3  # as many key/value heads as query heads
    packed[:, query : 2 * query] *= 1.05
    weight.CopyFrom(numpy_helper.from_array(packed, weight.name))
    plant(copy.out, "mha_one_stream.static-cache", proto)
    monkeypatch.chdir(copy.models.parent)
    graph = str(copy.out / "mha_one_stream.static-cache.onnx")
    result = CliRunner().invoke(cli, ["verify", graph, "--no-latency", "--distribution", "normal", "--localize"])
    assert result.exit_code == 1, result.output
    assert "DIVERGES first at ONNX node_linear_1 " in result.output, result.output
    assert "in k_linear at " in result.output, result.output
    # the whole graph runs as verify runs it, its pasts in buffers, its presents cut to the filled positions
    assert "fails to run" not in result.output and "output present.0.value: agrees" in result.output, result.output
    assert "in the whole graph: max abs" in result.output, result.output


@pytest.mark.slow
@needs_transformers
def test_a_hugging_face_llama_decodes_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's sdpa layer repeats its 2 cached key/value heads for its 4 query heads before
    SDPA (``repeat_kv``); the cache folds into the op all the same, so its in-place cache
    (and ort-past, at batch 1 where GroupQueryAttention takes a prompt on a cache) builds
    and decodes like PyTorch's growing cache."""
    from attn_export.pipelines.building import BuildOptions, build_models

    spec = write_spec(
        tmp_path / "models", "llama_one_stream", _one_stream((TINY_ZOO / "llama_sdpa_kv_cache.toml").read_text())
    )
    variants = ("ort-past", "static-cache")
    summary = build_models([spec], BuildOptions(tmp_path / "out", variants=variants))
    assert {r.name: r.error for r in summary.results if r.name != "llama_one_stream"} == {
        f"llama_one_stream.{v}": None for v in variants
    }
    proto = onnx.load(tmp_path / "out" / "llama_one_stream.static-cache.onnx")
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GroupQueryAttention") == 1
    assert not [n for n in proto.graph.node if "present.0.key" in n.input]  # its repeat (a copy each step) is gone
    monkeypatch.chdir(tmp_path)
    for variant in variants:
        graph = str(tmp_path / "out" / f"llama_one_stream.{variant}.onnx")
        result = CliRunner().invoke(cli, ["verify", graph, "--no-latency", "--decode", "3"])
        assert result.exit_code == 0, result.output
        assert "2 of 2 decode trajectories agree" in result.output or "1 of 1 decode" in result.output, result.output


def test_metadata_nested_too_deeply_is_malformed_not_an_internal_error() -> None:
    with pytest.raises(ArtifactError, match="metadata is malformed: maximum recursion depth"):
        StaticCache.from_metadata({METADATA_KEY: "[" * 100_000})


def test_a_fault_in_one_int8_packed_projection_is_localized_to_that_projection(built, tmp_path) -> None:
    """int8 replaces the packed MatMul by MatMulInteger and its scales; the record of the
    three projections goes on to the node giving the packed value, and localization cuts
    the three out of it with a Slice each. Planted: the key's columns' int8 scale doubled.
    Before, the quantized nodes, untraced, joined the attention's region and the fault was
    headlined at the attention and cache lines; the right graph has no region over its
    tolerance."""
    from onnx import numpy_helper

    copy = copy_build(built, tmp_path)
    name = "mha_one_stream.static-cache+int8"
    args = ["localize", str(copy.out), name, "--models", str(copy.models)]
    right = CliRunner().invoke(cli, [*args, "--strict-regions"])
    assert right.exit_code == 0 and "AGREES: " in right.output, right.output
    proto = onnx.load(copy.out / f"{name}.onnx")
    (scale,) = [t for t in proto.graph.initializer if t.name.endswith("/qkv_weight_scale")]
    scales = numpy_helper.to_array(scale).copy()
    query = scales.shape[0] // 3  # as many key/value heads as query heads
    scales[query : 2 * query] *= 2.0
    scale.CopyFrom(numpy_helper.from_array(scales, scale.name))
    plant(copy.out, name, proto)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "DIVERGES first at ONNX node_linear_1 (+1 nodes) [Slice+Add] from FX node linear_1 " in result.output
    assert "in k_linear at " in result.output and "self.k_linear(hidden_states)" in result.output, result.output


def test_a_fault_in_one_int4_packed_projection_is_localized_to_that_projection(built, tmp_path) -> None:
    """int4's quantizer replaces the packed MatMul by a MatMulNBits in place; the record of
    the three projections goes on to it, and localization cuts its value with a Slice each.
    Planted: the key's rows of its block scales ([N, blocks]) doubled. Before, the record
    was lost and the fault was judged in the attention's region. A right graph's regions
    hold against int4's simulation, the packed MatMulNBits counted as its three projections;
    the faulty one's alone breaks its tolerance."""
    from onnx import numpy_helper

    from attn_export.exporter.packed_projections import PACKED
    from attn_export.pipelines.localize import LocalizeOptions, localize_model

    copy = copy_build(built, tmp_path)
    name = "mha_one_stream.static-cache+int4"
    right = localize_model(copy.out, name, LocalizeOptions(models_dir=copy.models))
    assert right.passed(strict_regions=True), [r.fx_node for r in right.regions if r.breaks]
    proto = onnx.load(copy.out / f"{name}.onnx")
    (node,) = [n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[1].endswith("/qkv_weight_Q4")]
    kept = [p.value for p in node.metadata_props if p.key == PACKED]
    assert kept, f"the MatMulNBits '{node.name}' lost the packed projection's record"
    record = json.loads(kept[0])
    query, key = (int(part["columns"]) for part in record[:2])
    (scale,) = [t for t in proto.graph.initializer if t.name == node.input[2]]
    scales = numpy_helper.to_array(scale).copy()
    scales[query : query + key] *= 2.0
    scale.CopyFrom(numpy_helper.from_array(scales, scale.name))
    plant(copy.out, name, proto)
    report = localize_model(copy.out, name, LocalizeOptions(models_dir=copy.models))
    assert not report.passed() and report.first is not None and report.first.module_path == "k_linear"
    regions = {r.module_path: r for r in report.regions if r.module_path.endswith("_linear")}
    assert {p: r.ops for p, r in regions.items() if p != "out_linear"} == {
        p: ["Slice", "Add"] for p in ("q_linear", "k_linear", "v_linear")
    }
    assert regions["k_linear"].breaks and regions["k_linear"].fx_node == "linear_1"
    assert [p for p, r in regions.items() if r.local and not r.local.passed] == ["k_linear"]


@pytest.mark.slow  # a verify stopped at its limit (3 s)
def test_a_graph_updating_its_cache_in_place_is_stopped_at_the_run_limit_too(built, tmp_path: Path) -> None:
    """Its runs bind each past and present to one buffer (IOBinding), and that call ran with
    no limit: a Loop without end held verify until it was killed, --region-timeout or not."""
    copy = copy_build(built, tmp_path)
    name = "mha_one_stream.static-cache"
    plant(copy.out, name, endless_loop(onnx.load(copy.out / f"{name}.onnx")))
    started = time.perf_counter()
    args = ["verify", str(copy.out / f"{name}.onnx"), "--models", str(copy.models), "--region-timeout", "0.5"]
    result = CliRunner().invoke(cli, [*args, "--no-latency"])
    assert result.exit_code == 1 and time.perf_counter() - started < 60, result.output
    assert "ran past 0.5 s and was stopped (a Loop without end?)" in result.output, result.output
    assert "not run: an earlier run ran past 0.5 s and was stopped" in result.output, result.output


def test_gqa_rotary_on_a_graph_without_rotary_says_what_it_found_and_what_to_build(built) -> None:
    """It said "a module without rotary has nothing to fold" of a module whose rotary the
    exporter left as plain ops too (Phi-3's longrope, its frequencies picked by the length)."""
    from attn_export.errors import ExportFailure
    from attn_export.exporter.variants import gqa_rotary

    graph = onnx.load(built.out / "mha_one_stream.static-cache.onnx")
    with pytest.raises(
        ExportFailure, match="reads no RotaryEmbedding on both its query and its key; the graph holds no "
    ) as e:
        gqa_rotary.make(graph, "cpu", 40)
    assert str(e.value).endswith(
        "as longrope's, cannot be baked into GroupQueryAttention's cos/sin caches); build it without gqa-rotary"
    )
