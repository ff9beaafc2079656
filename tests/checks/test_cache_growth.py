"""Every present must grow by exactly the step's tokens, or keep its declared window:
verify --decode checks each one's shape at every step, the graph's and PyTorch's, and says
whose behaviour a violation is. Planted: a graph whose present holds one row too many, a
sliding-window graph that never trims (its logits still right) and a module that never
trims; a correct sliding-window cache passes, against PyTorch and its recording."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.checks.decode import DecodeResult
from attn_export.cli import cli
from attn_export.errors import GraphCheckError, SpecError
from attn_export.exporter.factory import instantiate
from attn_export.exporter.graph_checks import check_spec_axes, graph_shapes
from attn_export.exporter.torch_export import export_onnx
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes
from attn_export.pipelines.bench.decode_timing import plan_window
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, VerifyReport, verify_artifacts
from attn_export.runtimes.decoders import FeedbackDecoder
from attn_export.runtimes.torch_eager import TorchRuntime
from attn_export.zoo.kv_cache import MHAKVCache
from tests.conftest import TINY_ZOO, Built, copy_build, needs_transformers, plant, shared_build, unchanged, write_spec

WINDOW = 6
#: The tiny zoo's MHA decoder as a sliding window of 6 positions: its module keeps and sees
#: no more, and its spec declares so.
WINDOWED = (TINY_ZOO / "mha_kv_cache.toml").read_text().replace(
    "kwargs = { hidden_dim = 32, num_heads = 4 }", f"kwargs = {{ hidden_dim = 32, num_heads = 4, window = {WINDOW} }}"
) + f"\n[cache]\nwindow = {WINDOW}\n"
#: A prompt of 3 then 8 steps of one token: the window fills at step 4 (past 5 + 1).
KEPT = [0, 3, 4, 5, 6, 6, 6, 6, 6]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    built = shared_build(tmp_path_factory, "mha_window", lambda models: [write_spec(models, "mha_window", WINDOWED)])
    assert built.errors == {"mha_window": None}, built.errors
    with unchanged(built.out), unchanged(built.models):
        yield built


#: One case of the sweep beside the decode trajectories, which are what these tests judge.
ONE_CASE = {"batch": 1, "seq": 1, "past_seq": 0}


def _decode(out: Path, models: Path, name: str, golden: bool = False, **options: object) -> VerifyReport:
    shapes = None if golden else [ONE_CASE]
    opts = VerifyOptions(models_dir=models, latency=False, golden=golden, shapes=shapes, **options)  # type: ignore[arg-type]
    return verify_artifacts(out, load_manifest(out), [name], opts)


def _graph_of(module_class: type[MHAKVCache], spec_path: Path) -> onnx.ModelProto:
    """The graph of ``module_class`` with the spec's weights (its own export, unchecked)."""
    spec = load_spec(spec_path)
    module = module_class(**spec.kwargs).eval()
    module.load_state_dict(instantiate(spec).state_dict())
    return export_onnx(module, spec, make_feeds(spec, example_sizes(spec), 0), opset=18)


@pytest.fixture(scope="module")
def never_trims(windowed: Built) -> onnx.ModelProto:
    """The windowed decoder's graph exported from a module that masks by the window but
    never drops a key from its cache."""
    from tests.faulty_decoders import WindowNeverTrims

    return _graph_of(WindowNeverTrims, windowed.models / "mha_window.toml")


def test_a_sliding_window_cache_keeps_its_window_and_passes(windowed: Built) -> None:
    assert load_manifest(windowed.out).models["mha_window"].model_spec.cache_window == WINDOW
    shapes = graph_shapes(onnx.load(windowed.out / "mha_window.onnx"))
    assert shapes["present.0.key"] == ("batch", 4, f"Min({WINDOW}, total_seq)", 8)
    for golden in (False, True):
        report = _decode(windowed.out, windowed.models, "mha_window", golden=golden, decode_steps=8)
        assert report.passed, [r for d in report.decode for r in d.reasons()]
        assert {d.scenario for d in report.decode} == {"batch-1", "left-padded"}
        for d in report.decode:
            assert [s.past for s in d.steps] == KEPT  # fed back as kept: the window, once full
            assert [s.first for s in d.steps] == [0, *range(3, 11)]
            assert not any(s.growth or s.carry for s in d.steps)
            if not golden:  # the cache's newest positions agree with one pass over every token
                assert {c.name for c in d.steps[-1].recompute} == {"output", "present.0.key", "present.0.value"}


@pytest.mark.slow  # an export of its own: the every-report check runs by default on the window's plant
def test_a_graph_whose_present_grows_an_extra_row_fails_in_every_report(zoo_copy: Path, tmp_path: Path) -> None:
    from tests.faulty_decoders import PresentGrowsExtraRow

    plant(zoo_copy, "mha_kv_cache", _graph_of(PresentGrowsExtraRow, TINY_ZOO / "mha_kv_cache.toml"))
    reports = {fmt: tmp_path / f"r.{fmt}" for fmt in ("json", "junit", "markdown")}
    args = ["verify", str(zoo_copy / "mha_kv_cache.onnx"), "--models", str(TINY_ZOO), "--no-latency"]
    args += ["--shapes", "batch=1,seq=1,past_seq=0", "--decode", "2"]
    result = CliRunner().invoke(cli, [*args, *[a for f, p in reports.items() for a in (f"--{f}", str(p))]])
    assert result.exit_code == 1, result.output
    said = (
        "cache growth: at step 1 (past 0, seq 3) the graph's present.0.key holds 4 positions on axis 2, "
        "expected past 0 + 3 new = 3; PyTorch's module holds 3 positions on axis 2: the export's fault, "
        "not the module's"
    )
    assert f"FAIL mha_kv_cache onnxruntime[cpu] decode batch-1: {said}" in result.output
    doc = json.loads(reports["json"].read_text())
    decode = {d["scenario"]: d for d in doc["decode"]}
    assert decode["batch-1"]["cache_growth_from_step"] == 1 and decode["batch-1"]["reasons"][0] == said
    step = decode["batch-1"]["steps"][0]
    assert step["growth"][0] == {
        "output": "present.0.key",
        "past": 0,
        "seq": 3,
        "window": None,
        "expected": [1, 4, 3, 8],
        "graph": [1, 4, 4, 8],
        "module": [1, 4, 3, 8],
    }
    back = VerifyReport.from_dict(doc).decode[0]
    assert back.cache_growth is not None and back.reasons()[0] == said
    testcase = ET.parse(reports["junit"]).getroot().find("testsuite/testcase/failure")
    assert testcase is not None and f"decode batch-1: {said}" in (testcase.text or "")
    assert f"decode batch-1: {said}" in reports["markdown"].read_text()


def test_a_sliding_window_graph_that_never_trims_fails_in_every_report(
    windowed: Built, never_trims: onnx.ModelProto, tmp_path: Path
) -> None:
    built = copy_build(windowed, tmp_path)
    grows = (
        "mha_window: output 'present.0.key' axis 2 is 'total_seq' in the graph, but the spec's [cache] window "
        f"keeps {WINDOW} positions, Min({WINDOW}, total_seq): the graph's cache grows without bound"
    )
    with pytest.raises(GraphCheckError) as error:
        check_spec_axes(never_trims, "mha_window", load_spec(built.models / "mha_window.toml"))  # what build says
    assert str(error.value) == grows
    plant(built.out, "mha_window", never_trims)
    reports = {fmt: tmp_path / f"r.{fmt}" for fmt in ("json", "junit", "markdown")}
    args = ["verify", str(built.out), "--models", str(built.models), "--no-latency"]
    args += ["--shapes", "batch=1,seq=1,past_seq=0", "--decode", "8"]
    result = CliRunner().invoke(cli, [*args, *[a for f, p in reports.items() for a in (f"--{f}", str(p))]])
    assert result.exit_code == 1, result.output
    said = (
        f"cache growth: at step 5 (past {WINDOW}, seq 1) the graph's present.0.key holds 7 positions on axis 2, "
        f"expected min(past {WINDOW} + 1 new, window {WINDOW}) = {WINDOW}; PyTorch's module holds {WINDOW} "
        "positions on axis 2: the export's fault, not the module's"
    )
    for layout in ("batch-1", "left-padded"):
        assert f"FAIL mha_window onnxruntime[cpu] decode {layout}: {said}" in result.output
    doc = json.loads(reports["json"].read_text())
    assert doc["checks"][0]["problems"] == [grows]
    for d in doc["decode"]:
        assert d["cache_growth_from_step"] == 5 and d["reasons"][0] == said
        batch = len(d["prompt_lengths"])
        assert d["steps"][4]["growth"][0] == {
            "output": "present.0.key",
            "past": WINDOW,
            "seq": 1,
            "window": WINDOW,
            "expected": [batch, 4, WINDOW, 8],
            "graph": [batch, 4, 7, 8],
            "module": [batch, 4, WINDOW, 8],
        }
        outputs = {c["name"]: c["passed"] for c in d["steps"][4]["comparisons"]}
        assert outputs["output"] and not outputs["present.0.key"]  # the logits are still right
        assert all(s["passed"] for s in d["steps"][:4])
    back = VerifyReport.from_dict(doc).decode[0]
    assert back.cache_growth is not None and back.reasons()[0] == said
    failure = ET.parse(reports["junit"]).getroot().find("testsuite/testcase/failure")
    assert failure is not None and f"decode batch-1: {said}" in (failure.text or "")
    assert f"decode left-padded: {said}" in reports["markdown"].read_text()
    # each trajectory's command, in every report (there was none): run as printed, it fails the same way
    graph = built.out / "mha_window.onnx"
    command = f"attn-export verify {graph} --provider cpu --models {built.models} --decode 8 --seed 0 --no-latency"
    assert result.output.count(f"     reproduce: {command}\n") == 2, result.output
    assert (failure.text or "").count(f"  reproduce: {command}") == 2
    assert reports["markdown"].read_text().count(f"`{command}`") == 2
    again = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert again.exit_code == 1 and f"FAIL mha_window onnxruntime[cpu] decode left-padded: {said}" in again.output


def test_a_module_whose_cache_never_trims_is_reported_as_the_module(
    windowed: Built, never_trims: onnx.ModelProto, tmp_path: Path
) -> None:
    built = copy_build(windowed, tmp_path)
    plant(built.out, "mha_window", never_trims, module="tests.faulty_decoders:WindowNeverTrims", models=built.models)
    # four steps after the prompt: the last one is the first past the window, and PyTorch,
    # fed its own grown cache, would not take the next step's mask
    report = _decode(built.out, built.models, "mha_window", decode_steps=4)
    for d in report.decode:
        assert d.cache_growth is not None and d.first_divergence is None and d.module_bug is None, d.reasons()
        assert d.reasons() == [
            f"module bug: the module's own cache does not grow as declared: at step 5 (past {WINDOW}, seq 1) "
            "PyTorch's present.0.key holds 7 positions on axis 2, and the graph's the same, expected "
            f"min(past {WINDOW} + 1 new, window {WINDOW}) = {WINDOW}"
        ]
    longer = _decode(built.out, built.models, "mha_window", decode_steps=8)
    assert not longer.decode and len(longer.checks[0].problems) == 2
    assert longer.checks[0].problems[1].startswith("mha_window: decode batch-1: PyTorch failed at step 6: ")
    assert (
        longer.checks[0]
        .problems[1]
        .endswith(
            "; before that, module bug: the module's own cache does not grow as declared: at step 5 "
            f"(past {WINDOW}, seq 1) PyTorch's present.0.key holds 7 positions on axis 2, expected "
            f"min(past {WINDOW} + 1 new, window {WINDOW}) = {WINDOW}"
        )
    )


def _rescaled_past(proto: onnx.ModelProto, past: str, factor: float) -> onnx.ModelProto:
    """``proto`` with its ``past`` input multiplied by ``factor`` before anything reads it."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    for n in graph.node:
        n.input[:] = [f"{past}.rescaled" if i == past else i for i in n.input]
    scale = numpy_helper.from_array(np.array(factor, dtype=np.float32), f"{past}.factor")
    graph.initializer.append(scale)
    graph.node.insert(0, helper.make_node("Mul", [past, scale.name], [f"{past}.rescaled"]))
    return proto


def test_a_graph_that_rescales_its_cache_every_step_fails_though_its_outputs_agree(zoo_copy: Path) -> None:
    """A past key scaled by 1 + 2**-20 at every step keeps every output and present within
    atol over a few steps (a loose variant's tolerance hid a 1 % drift per step), and
    compounds without bound over a generation: PyTorch copies its past bit for bit."""
    proto = onnx.load(zoo_copy / "mha_kv_cache.onnx")
    plant(zoo_copy, "mha_kv_cache", _rescaled_past(proto, "past_key_values.0.key", 1 + 2**-20))
    report = _decode(zoo_copy, TINY_ZOO, "mha_kv_cache", decode_steps=3)
    assert not report.passed
    for d in report.decode:
        assert d.first_divergence is None, d.reasons()  # within atol: only the copy shows it
        step = d.cache_carry
        assert step is not None and step.step == 2 and [c.output for c in step.carry] == ["present.0.key"]
        assert d.reasons()[0].startswith(
            f"cache carry-over: at step 2 (past {step.past}, seq 1) the graph's present.0.key changed the "
            f"{step.past} positions it carries over from its past (max abs "
        )
        back = DecodeResult.from_dict(json.loads(json.dumps(d.to_dict())))
        assert back.cache_carry is not None and back.reasons() == d.reasons() and not back.passed


def test_a_step_result_with_growth_round_trips_through_json() -> None:
    from attn_export.checks.cache_growth import CacheGrowth
    from attn_export.checks.decode import DecodeStep
    from attn_export.runtimes import Target

    wrong_batch = CacheGrowth("present.0.value", 2, 1, None, [1, 4, 3, 8], [2, 4, 3, 8], [1, 4, 3, 8])
    step = DecodeStep(3, 2, 1, growth=[wrong_batch], start=2)
    result = DecodeResult("m", Target("onnxruntime", "cpu"), "batch-1", "golden", [2], steps=[step])
    assert DecodeResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert result.reasons() == [
        "cache growth: at step 3 (past 2, seq 1) the graph's present.0.value is [2, 4, 3, 8], expected "
        "[1, 4, 3, 8] (axis 2: past 2 + 1 new = 3; the other axes the past's); PyTorch's module holds 3 "
        "positions on axis 2: the export's fault, not the module's"
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("\n[cache]\nwindow = 0\n", "cache.window = 0 must be at least 1"),
        ("\n[cache]\nwindow = 4\nmax_seq = 40\n", "declares max_seq and window: .* declare one"),
        ("\n[cache]\nwindow = 25\n", "\\[cache\\] window = 25, but 'past_seq' max is 24"),
        ("\n[cache]\nsize = 4\n", "unknown key 'size' in \\[cache\\]"),
    ],
)
def test_a_window_declared_wrong_is_refused(tmp_path: Path, edit: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        load_spec(write_spec(tmp_path, "bad", (TINY_ZOO / "mha_kv_cache.toml").read_text() + edit))
    with pytest.raises(SpecError, match=r"\[cache\] window needs a past_key_values"):
        load_spec(write_spec(tmp_path, "plain", (TINY_ZOO / "mha.toml").read_text() + "\n[cache]\nwindow = 4\n"))


def test_bench_decode_feeds_a_window_what_it_keeps(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, "mha_window", WINDOWED))
    plan = plan_window(spec, batch=2, past=4, window=5, seed=0)
    assert len(plan.steps) == 5 and plan.pasts["past_key_values.0.key"].shape == (2, 4, 4, 8)
    assert [f["attention_mask"].shape[1] for f in plan.steps] == [5, 6, 7, 7, 7]  # kept past + the new token
    with TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims) as eager:
        decoder = FeedbackDecoder(eager, plan)  # each step's feeds checked, its presents fed back
        for _ in plan.steps:
            decoder.step()
        assert decoder.outputs()["present.0.key"].shape == (2, 4, WINDOW, 8)


@needs_transformers
@pytest.mark.slow
def test_a_hugging_face_sliding_window_cache_keeps_it_and_one_that_grows_fails(tmp_path: Path) -> None:
    # Mistral with transformers' own sliding-window cache layer: it keeps sliding_window - 1 = 7
    text = (TINY_ZOO / "mistral_sdpa_kv_cache.toml").read_text()
    text = text.replace("opset = 18", "kwargs = { cache_from_config = true }\nopset = 18", 1)
    text = text.replace("past_seq = { min = 0, max = 24 }", "past_seq = { min = 0, max = 7 }")
    spec_path = write_spec(tmp_path / "models", "mistral_window", text + "\n[cache]\nwindow = 7\n")
    summary = build_models([spec_path], BuildOptions(tmp_path / "out"))
    assert summary.results[0].error is None, summary.results[0].error
    report = _decode(tmp_path / "out", tmp_path / "models", "mistral_window", decode_steps=8)
    assert report.passed, [r for d in report.decode for r in d.reasons()] + report.checks[0].problems
    for d in report.decode:  # fed back as kept, the window once full
        assert [s.past for s in d.steps] == [min(s.first, 7) for s in d.steps] and d.steps[-1].past == 7
    # the same decoder exported with a cache that keeps every position: right logits, no trim
    spec = load_spec(spec_path)
    grows = instantiate(spec)
    grows.cache_from_config = False
    proto = export_onnx(grows, spec, make_feeds(spec, example_sizes(spec), 0), opset=18)
    plant(tmp_path / "out", "mistral_window", proto)
    report = _decode(tmp_path / "out", tmp_path / "models", "mistral_window", decode_steps=8)
    for d in report.decode:
        grew = d.cache_growth
        assert grew is not None and grew.past == 7, d.reasons()
        assert d.reasons()[0].startswith(
            f"cache growth: at step {grew.step} (past 7, seq 1) the graph's present.0.key holds 8 positions on axis 2, "
            "expected min(past 7 + 1 new, window 7) = 7; PyTorch's module holds 7"
        )
        assert next(c for c in grew.comparisons if c.name == "last_hidden_state").passed


@pytest.mark.parametrize(
    "axis",
    ["Min(6, total_seq) + 0*__import__('os').getpid()", "Min(6, " + "1+" * 400 + "total_seq)", "6", "Min(6, seq)"],
)
def test_a_windowed_present_axis_is_read_as_data_and_refused_in_one_line(windowed: Built, axis: str) -> None:
    proto = onnx.load(windowed.out / "mha_window.onnx")
    check_spec_axes(proto, "mha_window", load_spec(windowed.models / "mha_window.toml"))  # as built
    present = next(o for o in proto.graph.output if o.name == "present.0.key")
    present.type.tensor_type.shape.dim[2].dim_param = axis
    with pytest.raises(GraphCheckError, match=r"^mha_window: output 'present.0.key' axis 2 is .* in the graph, but"):
        check_spec_axes(proto, "mha_window", load_spec(windowed.models / "mha_window.toml"))
