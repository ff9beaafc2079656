"""KV-cache decoders: sum dims and empty caches in the spec, multi-step decoding against
PyTorch and against recorded trajectories, and a planted cache bug for each way decoders
break, each caught at the step where it first shows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.golden import encode_golden, read_golden
from attn_export.artifacts.manifest import load_manifest
from attn_export.checks.decode import DecodeResult
from attn_export.cli import cli
from attn_export.errors import ArtifactError, InputError, SpecError
from attn_export.exporter.factory import instantiate
from attn_export.exporter.torch_export import export_onnx
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes, sweep, validate_sizes
from attn_export.pipelines.verify import VerifyOptions, VerifyReport, verify_artifacts
from attn_export.report.junit import junit_xml
from attn_export.report.markdown import markdown_report
from attn_export.runtimes import check_feeds
from tests.conftest import HAS_TRANSFORMERS, TINY_ZOO, ZOO, Built, built_on_demand, plant, write_spec

CACHE_MODELS = ["gqa_rope_kv_cache", *(["llama_sdpa_kv_cache"] if HAS_TRANSFORMERS else []), "mha_kv_cache"]
MODULES = {
    "mha_kv_cache": "attn_export.zoo.kv_cache:MHAKVCache",
    "gqa_rope_kv_cache": "attn_export.zoo.kv_cache:GQARopeKVCache",
}


def _faulty(folder: Path, name: str, base: str, cls: str) -> Path:
    text = (TINY_ZOO / f"{base}.toml").read_text().replace(MODULES[base], f"tests.faulty_decoders:{cls}")
    return write_spec(folder, name, text)


def _decode(out: Path, models: Path, names: list[str], **options: object) -> VerifyReport:
    manifest = load_manifest(out)
    return verify_artifacts(out, manifest, names, VerifyOptions(models_dir=models, latency=False, **options))  # type: ignore[arg-type]


def _by_scenario(report: VerifyReport) -> dict[str, DecodeResult]:
    return {d.scenario: d for d in report.decode}


def test_spec_declares_an_empty_cache_and_a_sum_dim(tmp_path: Path) -> None:
    spec = load_spec(ZOO / "mha_kv_cache.toml")
    assert spec.dims["past_seq"].min == 0 and spec.dims["total_seq"].parts == ("past_seq", "seq")
    assert (spec.dims["total_seq"].min, spec.dims["total_seq"].max) == (1, 320)
    sizes = example_sizes(spec)
    assert sizes["total_seq"] == sizes["past_seq"] + sizes["seq"] and len(set(sizes.values())) == len(sizes)
    eight_heads = (ZOO / "mha_kv_cache.toml").read_text().replace('"batch", 4, ', '"batch", 8, ')
    sizes = example_sizes(load_spec(write_spec(tmp_path, "eight_heads", eight_heads)))
    assert sizes["total_seq"] not in (8, 16, 64) and len(set(sizes.values())) == len(sizes)  # 2+3+5 would be 8
    points = sweep(spec)
    assert points[0].sizes["past_seq"] == 0  # the sweep runs an empty cache
    assert all(p.sizes["total_seq"] == p.sizes["past_seq"] + p.sizes["seq"] for p in points)
    validate_sizes(spec, {"batch": 1, "seq": 2, "past_seq": 3})  # a sum may be left out
    with pytest.raises(InputError, match=r"total_seq=9, but total_seq = past_seq \+ seq = 5"):
        validate_sizes(spec, {"batch": 1, "seq": 2, "past_seq": 3, "total_seq": 9})
    feeds = make_feeds(spec, spec.with_sums({"batch": 2, "seq": 3, "past_seq": 4}), seed=0)
    feeds["attention_mask"] = np.ones((2, 8), dtype=np.int64)
    with pytest.raises(InputError, match=r"dim 'total_seq' is 8, but past_seq \+ seq is 7"):
        check_feeds(feeds, spec.inputs, spec.dims)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('total_seq = "past_seq + seq"', 'total_seq = "past_seq + nope"'), "a sum must add two or more distinct"),
        (('total_seq = "past_seq + seq"', 'total_seq = "past_seq"'), "a sum must add two or more distinct"),
        (("past_seq = { min = 0,", "past_seq = { min = -1,"), "min must be at least 0, got -1"),
        (('name = "present.0.value"', 'name = "present.1.value"'), "has no output 'present.0.value'"),
        (('total_seq = "past_seq + seq"', 'total_seq = "batch + seq"'), 'declare it in \\[dims\\] as "past_seq'),
        (('shape = ["batch", "total_seq"]', 'shape = [1, "total_seq"]'), 'declare layout = "key-padding" on it'),
    ],
)
def test_a_cache_declared_half_way_is_refused(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    text = (ZOO / "mha_kv_cache.toml").read_text()
    assert edit[0] in text
    with pytest.raises(SpecError, match=message):
        load_spec(write_spec(tmp_path, "bad", text.replace(edit[0], edit[1], 1)))


def test_zoo_decoders_decode_like_pytorch_and_like_their_recording(zoo_dir: Path) -> None:
    report = _decode(zoo_dir, TINY_ZOO, CACHE_MODELS)
    assert report.passed, [r for d in report.decode for r in d.reasons()]
    assert sorted((d.model, d.scenario) for d in report.decode) == [
        (m, s) for m in CACHE_MODELS for s in ("batch-1", "left-padded")
    ]
    for d in report.decode:
        assert [s.step for s in d.steps] == list(range(1, 10))  # the prompt and 8 decode steps
        assert d.steps[0].past == 0 and all(s.seq == 1 for s in d.steps[1:])
        assert all(s.recompute for s in d.steps)  # each step checked against one pass over every token
    assert 0 in _by_scenario(report)["left-padded"].prompt_lengths  # one row all padding at step 1
    golden = _decode(zoo_dir, TINY_ZOO, CACHE_MODELS, golden=True, decode_steps=3)
    assert golden.passed and {d.expected_from for d in golden.decode} == {"golden"}
    assert all(len(d.steps) == 4 for d in golden.decode)


def test_decode_judges_rounding_by_pytorchs_own_float32_error(zoo_dir: Path) -> None:
    # no tolerance of the user's own: every step is judged by 10x PyTorch's float32 error there
    for golden in (False, True):
        report = _decode(zoo_dir, TINY_ZOO, ["gqa_rope_kv_cache"], golden=golden, decode_steps=3, atol=0.0, rtol=0.0)
        assert report.decode and report.passed, [r for d in report.decode for r in d.reasons()]
        for d in report.decode:
            checked = [c for s in d.steps for c in (*s.comparisons, *s.recompute)]
            assert checked and all(c.atol > 0 and c.rtol == 0 for c in checked)


def test_decode_report_per_step_in_the_terminal_and_json(zoo_dir: Path, tmp_path: Path) -> None:
    args = [
        "verify",
        str(zoo_dir / "mha_kv_cache.onnx"),
        "--models",
        str(TINY_ZOO),
        "--no-latency",
        "--decode",
        "2",
        "--json",
        str(tmp_path / "r.json"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "LAYOUT       PROMPTS  RESULT MAX_ABS BY STEP" in result.output
    assert "2 of 2 decode trajectories agree (up to 2 steps after the prompt)" in result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["decode_trajectories"] == 2 and doc["settings"]["decode_steps"] == 2
    steps = doc["decode"][0]["steps"]
    assert [(s["step"], s["past"], s["seq"]) for s in steps] == [(1, 0, 3), (2, 3, 1), (3, 4, 1)]
    assert all(s["max_abs_error"] < 1e-5 and s["comparisons"] for s in steps)
    assert VerifyReport.from_dict(doc).decode[0].steps[2].past == 4


#: Each faulty decoder: the tiny zoo decoder it is written as, and the module class in its place.
FAULTY = {
    "top_left": ("mha_kv_cache", "TopLeftCausal"),
    "rope": ("gqa_rope_kv_cache", "RotaryNotOffset"),
    "zeros": ("mha_kv_cache", "PresentWithoutNewToken"),
    "drops": ("mha_kv_cache", "PresentDropsNewToken"),
    "baked": ("gqa_rope_kv_cache", "PastBaked"),
    "prompt_path": ("mha_kv_cache", "PromptIgnoresPadding"),
    "ignores": ("mha_kv_cache", "IgnoresMask"),
    "first_row": ("mha_kv_cache", "FirstRowMask"),
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """Each faulty decoder built when a test first asks for it."""
    return built_on_demand(tmp_path_factory, lambda folder, name: _faulty(folder, name, *FAULTY[name]))


@pytest.mark.parametrize(
    ("name", "step", "why"),
    [
        ("top_left", 2, {"output"}),  # right while the cache is empty
        # position 0 again for the first decoded token
        pytest.param("rope", 2, {"output", "present.0.key"}, marks=pytest.mark.slow),
        # the cache read back holds no keys for the tokens before
        pytest.param("zeros", 2, {"output"}, marks=pytest.mark.slow),
    ],
)
def test_a_cache_bug_in_the_module_is_reported_as_such_at_its_step(faulty, name: str, step: int, why: set[str]) -> None:
    built = faulty(name)
    assert built.errors[name] is None, built.errors  # the graph is faithful to a wrong module
    report = _decode(built.out, built.models, [name])
    assert not report.failed_cases and not report.passed
    for d in report.decode:
        assert d.module_bug is not None and d.module_bug.step == step, d.reasons()
        assert d.first_divergence is None  # ONNX Runtime agrees with PyTorch, bug and all
        assert d.reasons()[0].startswith(
            f"module bug: with its cache the module disagrees with one pass over every token, from step {step}"
        )
        assert {c.name for c in d.module_bug.recompute if not c.passed} == why


def test_a_present_without_the_new_token_fails_the_build_naming_the_axis(faulty) -> None:
    assert faulty("drops").errors["drops"] == (
        "drops: output 'present.0.key' axis 2 is 'total_seq - 1' in the graph, but the spec declares "
        "total_seq = past_seq + seq"
    )


def test_a_past_length_baked_from_the_example_fails_the_build_naming_the_line(faulty) -> None:
    error = faulty("baked").errors["baked"]
    assert error is not None and "specialized it to be a constant" in error
    assert "faulty_decoders.py:" in error and "`t = int(full.shape[2])`" in error


def test_a_branch_on_an_empty_cache_kept_without_a_guard_fails_the_build_naming_the_line(faulty) -> None:
    error = faulty("prompt_path").errors["prompt_path"]
    assert error is not None and "smoke check at" in error and "past_seq=0" in error
    assert "the module's Python takes another path at" in error
    assert "faulty_decoders.py:" in error and "`attention_mask = torch.ones_like(attention_mask)`" in error


def test_a_graph_that_breaks_on_a_fully_left_padded_row_diverges_at_step_1(zoo_copy: Path) -> None:
    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    module = instantiate(spec)  # same weights, attention through SDPA: the export gives no 0 for empty rows
    from tests.faulty_decoders import SafeSoftmaxOnly

    faulty = SafeSoftmaxOnly(**spec.kwargs).eval()
    faulty.load_state_dict(module.state_dict())
    plant(zoo_copy, "mha_kv_cache", export_onnx(faulty, spec, make_feeds(spec, example_sizes(spec), 0), opset=18))
    for golden in (False, True):
        decode = _by_scenario(_decode(zoo_copy, TINY_ZOO, ["mha_kv_cache"], golden=golden, decode_steps=2))
        assert decode["batch-1"].passed  # no padding, nothing to see
        first = decode["left-padded"].first_divergence
        assert first is not None and first.step == 1, decode["left-padded"].reasons()
        assert decode["left-padded"].module_bug is None


@pytest.mark.parametrize("name", ["ignores", pytest.param("first_row", marks=pytest.mark.slow)])
def test_a_mask_the_module_misreads_fails_where_padding_is(faulty, name: str, tmp_path: Path) -> None:
    built = faulty(name)
    assert built.errors[name] is None, built.errors
    report = _decode(built.out, built.models, [name])
    decode = _by_scenario(report)
    assert decode["batch-1"].passed  # one row, no padding: nothing to misread
    reasons = decode["left-padded"].reasons()
    assert reasons and reasons[0].startswith("module bug: padding changes what a real token sees")
    junit = junit_xml(report)
    assert 'failures="1"' in junit and "padding changes what a real token sees" in junit
    assert "| left-padded | 3,0,1 | **FAIL** |" in markdown_report(report)


def test_golden_decode_refuses_a_recording_with_a_scenario_or_a_step_missing(zoo_copy: Path) -> None:
    path = zoo_copy / "mha_kv_cache.golden.npz"
    cases = read_golden(path)
    for drop in ("decode-left-padded-", "decode-batch-1-4"):
        path.write_bytes(encode_golden([c for c in cases if not c.label.startswith(drop)]))
        doc = json.loads((zoo_copy / "manifest.json").read_text())
        doc["models"]["mha_kv_cache"]["golden_sha256"] = sha256_file(path)
        (zoo_copy / "manifest.json").write_text(json.dumps(doc))
        scenario = "left-padded" if "left" in drop else "batch-1"
        with pytest.raises(ArtifactError, match=f"the decode recording of '{scenario}' is missing or has gaps"):
            _decode(zoo_copy, TINY_ZOO, ["mha_kv_cache"], golden=True)
