"""bench --decode: a real small run gives one row per runner and past length with figures
that hang together; the bound ONNX Runtime path feeds its presents back and gives what a
plain session.run gives; a model without a cache is one line and exit 2; torch.compile's
decoder compiles as the cache first grows and then reuses one graph, and without a C++
compiler it is one line in the report. No timing assertions: figures belong to the
benchmark, not the tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.exporter.factory import instantiate
from attn_export.model_spec import load_spec
from attn_export.pipelines.bench.decode_timing import past_lengths, plan_window
from attn_export.pipelines.bench.results import DecodeBenchReport
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.runtimes.decoders import EagerDecoder, OrtDecoder
from attn_export.runtimes.ort import load_session
from attn_export.runtimes.torch_compiled import CompiledTorchRuntime
from tests.conftest import TINY_ZOO, ZOO, endless_loop, plant, tiny_spec
from tests.report.test_benchmark_json import custom_smaller_is_better

#: The production spec, for what needs no build; the tiny zoo's for what runs.
SPEC = ZOO / "mha_kv_cache.toml"
TINY_SPEC = TINY_ZOO / "mha_kv_cache.toml"
RUNNERS = {"torch-eager", "ort:fp32", "ort:int8"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("decode") / "out"
    summary = build_models([TINY_SPEC], BuildOptions(out, variants=("fp32", "int8")))
    assert all(r.ok for r in summary.results), [r.error for r in summary.results]
    return out


@pytest.fixture(scope="module")
def decode_run(built: Path) -> tuple[Path, object]:
    folder = built.parent
    args = ["bench", str(TINY_SPEC), "--decode", "--past", "0,16", "--out", str(built), "--variant", "fp32"]
    args += ["--variant", "int8", "--budget", "0.01", "--threads", "1", "--json", str(folder / "decode.json")]
    args += ["--markdown", str(folder / "decode.md"), "--plot", str(folder / "decode.png")]
    args += ["--benchmark-json", str(folder / "benchmark.json")]
    return folder, CliRunner().invoke(cli, args)


def test_one_row_per_runner_and_past_with_consistent_figures(decode_run) -> None:
    folder, result = decode_run
    assert result.exit_code == 0, result.output
    report = DecodeBenchReport.from_dict(json.loads((folder / "decode.json").read_text()))
    assert sorted((r.runner, r.past) for r in report.rows) == sorted((n, p) for n in RUNNERS for p in (0, 16))
    for r in report.rows:
        assert r.batch == 1 and r.window == 8
        assert r.latency.p50_ms > 0 and r.latency.p90_ms >= r.latency.p50_ms and r.latency.repeats >= 4
        assert r.tokens_per_s == pytest.approx(1000 / r.latency.p50_ms)
        if r.runner == "torch-eager":
            assert r.ratio_to_eager == 1.0 and r.verdict is None
        else:
            eager = next(e for e in report.rows if e.runner == "torch-eager" and e.past == r.past)
            assert r.ratio_to_eager == pytest.approx(r.latency.p50_ms / eager.latency.p50_ms)
            assert r.verdict in ("faster", "slower", "within noise")
    assert set(report.memory_mb["mha_kv_cache"]) == RUNNERS
    assert all(v is not None and v > 0 for v in report.memory_mb["mha_kv_cache"].values())
    assert report.threads == 1 and report.seed == 0 and "random" in report.prefill
    assert report.to_dict() == DecodeBenchReport.from_dict(report.to_dict()).to_dict()


def test_every_row_carries_the_bytes_its_step_moves_and_its_bandwidth_limit(decode_run, built: Path) -> None:
    """Bytes per token counted by hand for the tiny decoder: weights as stored (int8: one byte
    per weight), the cache read (4 heads x 8 dims x 4 bytes per position, key and value, at
    the window's mean past) and the presents written (one position longer)."""
    from onnx import numpy_helper

    from attn_export.artifacts.manifest import load_manifest

    folder, result = decode_run
    assert result.exit_code == 0, result.output
    report = DecodeBenchReport.from_dict(json.loads((folder / "decode.json").read_text()))
    assert report.copy_gbps is not None and report.copy_gbps > 0
    manifest = load_manifest(built)
    module = instantiate(load_spec(TINY_SPEC))
    weights = {
        "torch-eager": sum(p.numel() * 4 for p in module.parameters()) + sum(b.nbytes for b in module.buffers()),
        **{
            f"ort:{v}": sum(
                numpy_helper.to_array(t).nbytes
                for t in onnx.load(
                    built / manifest.models[f"mha_kv_cache{'' if v == 'fp32' else '.' + v}"].file
                ).graph.initializer
            )
            for v in ("fp32", "int8")
        },
    }
    assert weights["ort:int8"] < weights["ort:fp32"] / 2
    position = 2 * 4 * 8 * 4  # key and value: heads x head_dim x float32
    for r in report.rows:
        mean_past = r.past + (r.window - 1) / 2
        expected = weights[r.runner] + int(mean_past * position) + int((mean_past + 1) * position)
        assert r.bytes_per_token == pytest.approx(expected, abs=1)
        assert r.gbps == pytest.approx(r.bytes_per_token / (r.latency.p50_ms / 1e3) / 1e9)
        limit_ms = r.bytes_per_token / (report.copy_gbps * 1e9) * 1e3
        assert r.limit_ratio == pytest.approx(r.latency.p50_ms / limit_ms)
        if r.runner == "torch-eager":
            assert r.outside_kernels is None
        else:
            assert r.outside_kernels is not None and 0 < r.outside_kernels < 1
    assert "MB/TOK" in result.output.splitlines()[0] and "VS_LIMIT" in result.output.splitlines()[0]
    assert "copy bandwidth" in result.output


def test_benchmark_json_has_one_entry_per_decode_row(decode_run) -> None:
    folder, result = decode_run
    assert result.exit_code == 0, result.output
    report = DecodeBenchReport.from_dict(json.loads((folder / "decode.json").read_text()))
    entries = custom_smaller_is_better((folder / "benchmark.json").read_text())
    names = [f"mha_kv_cache {r.runner} [cpu] decode batch=1 past={r.past}" for r in report.rows]
    assert [e["name"] for e in entries] == names and len(names) == 6
    assert [e["value"] for e in entries] == [r.latency.p50_ms for r in report.rows]
    assert all("window: 8 steps" in e["extra"] for e in entries)
    for e, r in zip(entries, report.rows, strict=True):  # the row's physics in the chart's tooltip
        assert f"MB/token: {r.bytes_per_token / 1e6:.3f}\nGB/s: {r.gbps:.1f}\nvs bandwidth limit: " in e["extra"]


def test_table_markdown_and_plot(decode_run) -> None:
    folder, result = decode_run
    assert result.output.splitlines()[0].split()[:6] == ["MODEL", "RUNNER", "BATCH", "PAST", "SEQ", "MS/STEP"]
    assert "peak memory mha_kv_cache: torch-eager" in result.output
    lines = (folder / "decode.md").read_text().splitlines()
    assert lines[0].startswith("| model | runner | batch | past | seq | ms/step p50 |") and len(lines) == 2 + 6
    pytest.importorskip("matplotlib")
    assert (folder / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bound_steps_match_plain_runs_and_feed_presents_back(built: Path) -> None:
    spec = load_spec(TINY_SPEC)
    plan = plan_window(spec, batch=2, past=5, window=3, seed=1)
    session = load_session(built / "mha_kv_cache.onnx", threads=1)
    decoder = OrtDecoder(session, spec, plan)
    names = [o.name for o in session.get_outputs()]
    pasts = dict(plan.pasts)
    for k in range(3):
        decoder.step()
        got = decoder.outputs()
        expected = dict(zip(names, session.run(None, plan.feeds(k, pasts)), strict=True))
        assert got["present.0.key"].shape == (2, 4, 5 + k + 1, 8)
        for name in names:
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)
        pasts = {
            "past_key_values.0.key": expected["present.0.key"],
            "past_key_values.0.value": expected["present.0.value"],
        }
    decoder.step()  # the window is used up: it starts again from the prefilled cache
    assert decoder.outputs()["present.0.key"].shape == (2, 4, 6, 8)


def test_eager_decodes_the_same_tokens_as_onnx_runtime(built: Path) -> None:
    spec = load_spec(TINY_SPEC)
    plan = plan_window(spec, batch=1, past=3, window=2, seed=2)
    eager = EagerDecoder(instantiate(spec), spec, plan)
    bound = OrtDecoder(load_session(built / "mha_kv_cache.onnx", threads=1), spec, plan)
    for _ in range(2):
        eager.step()
        bound.step()
        want, got = eager.outputs(), bound.outputs()
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
    assert want["present.0.value"].shape == (1, 4, 5, 8)


def test_default_pasts_are_clamped_to_the_spec_range() -> None:
    assert past_lengths(load_spec(SPEC)) == [0, 128, 256]
    assert past_lengths(load_spec(SPEC), [64, 0, 64]) == [64, 0]


def test_window_grows_mask_and_positions_with_the_cache() -> None:
    spec = load_spec(ZOO / "gqa_rope_kv_cache.toml")
    plan = plan_window(spec, batch=2, past=250, window=8, seed=0)
    assert len(plan.steps) == 7  # past 250 .. 256, where the spec's range ends
    assert plan.pasts["past_key_values.0.key"].shape == (2, 2, 250, 8)
    for k, feeds in enumerate(plan.steps):
        assert feeds["attention_mask"].shape == (2, 250 + k + 1) and feeds["attention_mask"].all()
        assert (feeds["position_ids"] == 250 + k).all() and feeds["position_ids"].shape == (2, 1)
        assert feeds["hidden_states"] is plan.steps[0]["hidden_states"]


def test_zoo_without_a_cache_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    tiny_spec(tmp_path / "models")
    result = CliRunner().invoke(cli, ["bench", "--decode", "--models", str(tmp_path / "models")])
    assert result.exit_code == 2
    assert result.output == "Error: bench --decode: none of these models has a key/value cache\n"


def test_model_without_a_cache_is_one_line_and_exit_2(tmp_path: Path) -> None:
    tiny_spec(tmp_path / "models")
    result = CliRunner().invoke(cli, ["bench", "tiny", "--decode", "--models", str(tmp_path / "models")])
    assert result.exit_code == 2
    assert result.output == (
        "Error: tiny: bench --decode needs a model with a key/value cache (inputs past_key_values.<i>.key/value, "
        "outputs present.<i>.key/value); it declares none\n"
    )
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode", "--past", "0,300"], "Error: mha_kv_cache: past length 300 is outside 'past_seq' [0, 256]"),
        (["--decode", "--seq", "8"], "Error: --seq has no meaning with --decode"),
        (["--past", "0,128"], "Error: --past needs --decode"),
        (["--decode", "--past", "-1"], "'-1' is not a list of sizes"),
        # the window's last step reads 16 + 7 positions: the first step alone was checked
        (
            ["--decode", "--past", "16", "--max-memory", "1KiB"],
            "case the deepest step from batch 1, past 16 (batch=1,seq=1,past_seq=23,total_seq=24) needs at least",
        ),
    ],
)
def test_bad_decode_options_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", str(SPEC), "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "out").exists()


def test_a_scenario_times_its_steps_of_several_tokens(built: Path, tmp_path: Path) -> None:
    args = ["bench", str(TINY_SPEC), "--scenario", "speculative", "--out", str(built), "--variant", "fp32"]
    args += ["--budget", "0.01", "--threads", "1", "--no-memory", "--json", str(tmp_path / "s.json")]
    result = CliRunner().invoke(cli, [*args, "--benchmark-json", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    names = [e["name"] for e in json.loads((tmp_path / "b.json").read_text())]
    assert names == [f"mha_kv_cache {r} [cpu] speculative batch=1 past=20 seq=4" for r in ("torch-eager", "ort:fp32")]
    assert "scenario speculative: a step of SEQ tokens" in result.output
    report = DecodeBenchReport.from_dict(json.loads((tmp_path / "s.json").read_text()))
    assert sorted(r.runner for r in report.rows) == ["ort:fp32", "torch-eager"]
    for r in report.rows:
        assert (r.batch, r.past, r.seq, r.window, r.scenario) == (1, 20, 4, 1, "speculative")
        assert r.tokens_per_s == pytest.approx(4 * 1000 / r.latency.p50_ms)
    fixed = CliRunner().invoke(cli, ["bench", str(TINY_SPEC), "--scenario", "speculative", "--past", "3"])
    assert fixed.exit_code == 2 and "--scenario sets the batch, past and query tokens: drop --past" in fixed.output


def test_a_window_of_several_tokens_per_step_positions_each_token() -> None:
    spec = load_spec(ZOO / "gqa_rope_kv_cache.toml")
    plan = plan_window(spec, batch=2, past=240, window=8, seed=0, seq=4)
    assert len(plan.steps) == 5  # past 240, 244, ..., 256: where the spec's range ends
    for k, feeds in enumerate(plan.steps):
        assert feeds["attention_mask"].shape == (2, 240 + 4 * (k + 1))
        assert feeds["position_ids"].tolist() == [list(range(240 + 4 * k, 244 + 4 * k))] * 2
        assert feeds["hidden_states"].shape == (2, 4, 64)


def test_compile_without_a_cxx_compiler_is_one_line_in_the_decode_report(built: Path, tmp_path: Path) -> None:
    from torch._inductor import config

    args = ["bench", str(TINY_SPEC), "--decode", "--past", "0", "--out", str(built), "--variant", "fp32", "--compile"]
    args += ["--budget", "0.01", "--threads", "1", "--no-memory", "--json", str(tmp_path / "d.json")]
    with config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        result = CliRunner().invoke(cli, [*args, "--markdown", str(tmp_path / "d.md")])
    assert result.exit_code == 0, result.output
    why = "Inductor needs a C++ compiler and /nonexistent/c++ does not run here (install g++, or name one in CXX)"
    assert f"torch-compile not timed: {why}\n" in result.output
    report = DecodeBenchReport.from_dict(json.loads((tmp_path / "d.json").read_text()))
    assert report.unavailable == {"torch-compile": why}
    assert [r.runner for r in report.rows] == ["torch-eager", "ort:fp32"]
    assert report.to_dict() == DecodeBenchReport.from_dict(report.to_dict()).to_dict()
    markdown = (tmp_path / "d.md").read_text()
    assert markdown.endswith(f"|\n\ntorch-compile not timed: {why}\n") and "compile (s)" not in markdown


@pytest.mark.slow
def test_compiled_decode_rows_compile_while_the_cache_first_grows_then_reuse_one_graph(
    built: Path, tmp_path: Path
) -> None:
    args = ["bench", str(TINY_SPEC), "--decode", "--past", "0,16", "--out", str(built), "--variant", "fp32"]
    args += ["--compile", "--budget", "0.01", "--threads", "1", "--no-memory", "--json", str(tmp_path / "d.json")]
    result = CliRunner().invoke(cli, [*args, "--markdown", str(tmp_path / "d.md")])
    assert result.exit_code == 0, result.output
    report = DecodeBenchReport.from_dict(json.loads((tmp_path / "d.json").read_text()))
    assert [(r.runner, r.past) for r in report.rows] == [
        (run, p) for p in (0, 16) for run in ("torch-eager", "torch-compile", "ort:fp32")
    ]
    empty, grown = (r for r in report.rows if r.runner == "torch-compile")
    # past 0 and 1 are specialised, past 2 compiles the graph dynamic in the cache's length,
    # which every later past reuses: past 16 compiled nothing
    assert empty.compile_s is not None and empty.compile_s > 0 and grown.compile_s == 0.0
    assert empty.latency.mean_ms * empty.latency.repeats < 1000 * empty.compile_s
    assert all(r.compile_s is None for r in report.rows if r.runner != "torch-compile")
    assert grown.verdict in ("faster", "slower", "within noise") and grown.ratio_to_eager is not None
    assert f"compile {empty.compile_s:.2f} s" in result.output
    assert (tmp_path / "d.md").read_text().splitlines()[0].endswith("| verdict | compile (s) |")


@pytest.mark.slow
def test_the_compiled_decoder_decodes_the_same_tokens_as_eager() -> None:
    spec = load_spec(TINY_SPEC)
    plan = plan_window(spec, batch=2, past=3, window=3, seed=2)
    eager = EagerDecoder(instantiate(spec), spec, plan)
    with CompiledTorchRuntime(instantiate(spec), spec.inputs, spec.outputs, threads=1) as compiled:
        decoder = compiled.decoder(plan)
        assert compiled.compile_s is not None and compiled.compile_s > 0
        for _ in range(3):  # the warm-up pass restarted the window: these are steps 0, 1, 2 again
            eager.step()
            decoder.step()
            want, got = eager.outputs(), decoder.outputs()
            for name, value in want.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
        assert want["present.0.key"].shape == (2, 4, 6, 8)
        compiled.decoder(plan_window(spec, batch=2, past=9, window=3, seed=2))
        assert compiled.compile_s == 0.0


def test_the_deepest_step_of_a_window_is_the_one_its_memory_is_checked_at() -> None:
    """The first step alone was checked; a sliding window holds the newest of the tokens."""
    import dataclasses

    from attn_export.model_spec.cache import cache_of
    from attn_export.pipelines.bench.decode_timing import _deepest

    spec = load_spec(SPEC)
    cache = cache_of(spec)
    assert cache is not None
    assert _deepest(spec, cache, 16, 1, 8) == 23 and _deepest(spec, cache, 0, 4, 8) == 28
    top = spec.dims["past_seq"].max
    assert _deepest(spec, cache, top - 2, 1, 8) == top  # a window ends with the range
    assert _deepest(spec, dataclasses.replace(cache, window=5), 0, 1, 8) == 5


def test_the_plot_titles_a_step_by_its_tokens_and_marks_a_lone_limit(
    decode_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A scenario's step of several tokens was titled "one decode step", and a limit at a
    single past length was a dashed line of one point, which draws nothing."""
    pytest.importorskip("matplotlib")
    import dataclasses

    from attn_export.report import plot

    folder, _ = decode_run
    report = DecodeBenchReport.from_dict(json.loads((folder / "decode.json").read_text()))
    drawn: list = []
    monkeypatch.setattr(plot, "_finish", lambda fig, report, path: drawn.append(fig))
    plot.plot_decode_latency(report, tmp_path / "x.png")
    ax, moved, speed = drawn[-1].axes
    assert ax.get_title().endswith(", one decode step")
    # beside the latency, each row's bytes per token and achieved bandwidth, the copy's across it
    assert (moved.get_ylabel(), speed.get_ylabel()) == ("MB moved per token", "achieved GB/s")
    lines = {line.get_label(): line for line in speed.get_lines()}
    onnx = sorted((r.past, r.gbps) for r in report.rows if r.runner == "ort:fp32")
    assert list(lines["ort:fp32"].get_ydata()) == [g for _, g in onnx]
    assert list(lines[f"copy bandwidth {report.copy_gbps:.1f} GB/s"].get_ydata()) == [report.copy_gbps] * 2
    eager = sorted((r.past, r.bytes_per_token / 1e6) for r in report.rows if r.runner == "torch-eager")
    assert list({x.get_label(): x for x in moved.get_lines()}["torch-eager"].get_ydata()) == [b for _, b in eager]
    lone = [dataclasses.replace(r, seq=4) for r in report.rows if r.past == report.rows[0].past]
    plot.plot_decode_latency(dataclasses.replace(report, rows=lone), tmp_path / "x.png")
    ax = drawn[-1].axes[0]
    assert ax.get_title().endswith(", a step of 4 tokens")
    limits = [line for line in ax.get_lines() if line.get_label().endswith("bandwidth limit")]
    assert limits and all(line.get_marker() == "x" for line in limits)


@pytest.mark.slow  # a bench run stopped at its limit (3 s)
def test_a_decoder_whose_loop_never_ends_fails_bench_decode_in_one_line(built: Path, tmp_path: Path) -> None:
    """Its steps were bound and timed with no limit, a Loop without end held the run: a graph
    holding a Loop takes one step bounded by --region-timeout before its timed steps, which
    stay bound (IOBinding) and untimed by any limit (a timer would be timed with each: a
    harmless Loop read 7 x slower than the same graph without it)."""
    from attn_export.runtimes.ort import OnnxRuntime

    out = Path(shutil.copytree(built, tmp_path / "out"))
    proto = endless_loop(onnx.load(out / "mha_kv_cache.onnx"))
    once = onnx.load_from_string(proto.SerializeToString())
    once.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), "once"))
    next(n for n in once.graph.node if n.op_type == "Loop").input[0] = "once"  # one iteration: harmless
    spec = load_spec(TINY_SPEC)
    with OnnxRuntime(once.SerializeToString(), spec.inputs, spec.outputs, threads=1) as runtime:
        assert isinstance(runtime.decoder(plan_window(spec, batch=1, past=3, window=2, seed=2)), OrtDecoder)
    plant(out, "mha_kv_cache", proto)
    args = ["bench", str(TINY_SPEC), "--decode", "--past", "8", "--out", str(out), "--variant", "fp32"]
    stopped = CliRunner().invoke(cli, [*args, "--budget", "0.01", "--no-memory", "--region-timeout", "0.5"])
    assert stopped.exit_code == 1, stopped.output
    assert stopped.output.strip().splitlines()[-1] == (
        "Error: mha_kv_cache ort:fp32: onnxruntime[cpu]: ran past 0.5 s and was stopped (a Loop without end?)"
    )
