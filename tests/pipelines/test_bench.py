"""bench: JSON holds every requested shape and runner; the plot is a real PNG; torch.compile's
rows keep its compile time apart, and without a C++ compiler it is one line in the report.
No timing assertions: figures belong to the benchmark, not the tests."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import InputError
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.pipelines.bench.physics import profile_calls
from attn_export.pipelines.bench.results import BenchReport
from tests.conftest import TINY_ZOO, Built, endless_loop, plant, tiny_spec
from tests.report.test_benchmark_json import custom_smaller_is_better


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("bench")
    tiny_spec(folder / "models")
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            str(folder / "models" / "tiny.toml"),  # a spec file, no --models
            "--out",
            str(folder / "out"),
            "--batch",
            "1,2",
            "--seq",
            "4,8,...,32",
            "--variant",
            "fp32",
            "--variant",
            "int8",
            "--budget",
            "0.01",
            "--threads",
            "1",
            "--json",
            str(folder / "bench.json"),
            "--markdown",
            str(folder / "out" / "bench.md"),  # in the folder bench makes: its reports may go there
            "--plot",
            str(folder / "latency.png"),
            "--benchmark-json",
            str(folder / "benchmark.json"),
        ],
    )
    return folder, result


def test_bench_json_holds_every_shape_and_runner(bench_run) -> None:
    folder, result = bench_run
    assert result.exit_code == 0, result.output
    report = BenchReport.from_dict(json.loads((folder / "bench.json").read_text()))
    runners = {"torch-eager", "torch-sdpa", "ort:fp32", "ort:int8"}
    got = {(r.runner, r.batch, r.seq) for r in report.rows}
    assert got == {(run, b, s) for run in runners for b in (1, 2) for s in (4, 8, 16, 32)}
    for r in report.rows:
        assert r.latency.p50_ms > 0 and r.latency.p90_ms >= r.latency.p50_ms and r.latency.repeats >= 3
        assert r.flops > 0 and r.gflops > 0 and r.tokens_per_s > 0
        assert r.in_verified_range == (r.seq <= 24)
    eager = [r for r in report.rows if r.runner == "torch-eager"]
    assert all(r.ratio_to_eager == 1.0 for r in eager)
    assert report.peak_gflops["peak"] == max(report.peak_gflops["torch"], report.peak_gflops["onnxruntime"])
    assert set(report.memory_mb["tiny"]) == {"torch-eager", "ort:fp32", "ort:int8"}
    assert all(v is not None and v > 0 for v in report.memory_mb["tiny"].values())
    assert report.to_dict() == BenchReport.from_dict(report.to_dict()).to_dict()


def test_benchmark_json_has_one_entry_per_row_named_by_what_it_measured(bench_run) -> None:
    folder, result = bench_run
    assert result.exit_code == 0, result.output
    report = BenchReport.from_dict(json.loads((folder / "bench.json").read_text()))
    entries = custom_smaller_is_better((folder / "benchmark.json").read_text())
    assert len(entries) == len(report.rows) == 32
    for entry, row in zip(entries, report.rows, strict=True):
        assert entry["name"] == f"tiny {row.runner} [cpu] batch={row.batch} seq={row.seq}"
        assert entry["value"] == row.latency.p50_ms
        assert entry["range"] == f"± {row.latency.p90_ms - row.latency.p50_ms:.4f}"
        assert f"repeats: {row.latency.repeats}" in entry["extra"].splitlines()
        assert ("outside the verified range" in entry["extra"]) == (row.seq > 24)


def test_bench_flops_count_projections_and_both_attention_matmuls(bench_run) -> None:
    folder, _ = bench_run
    report = BenchReport.from_dict(json.loads((folder / "bench.json").read_text()))
    row = next(r for r in report.rows if (r.batch, r.seq, r.runner) == (2, 8, "torch-eager"))
    hidden, b, s = 16, 2, 8
    projections = 4 * 2 * b * s * hidden * hidden
    attention = 2 * (2 * b * s * s * hidden)
    assert row.flops == projections + attention


def test_bench_markdown_and_table(bench_run) -> None:
    folder, result = bench_run
    lines = (folder / "out" / "bench.md").read_text().splitlines()
    assert lines[0].startswith("| model | runner | batch | seq | p50 (ms)")
    assert len(lines) == 2 + 32
    assert "float32 GEMM peak (2048^3):" in result.output
    assert "(outside the verified range)" in result.output  # seq 32 > the spec's 24
    outside = [line for line in lines if "| 32 | " in line]  # and in the Markdown
    assert len(outside) == 2 * 4 and all("| outside the verified range" in line for line in outside)


def test_bench_plot_is_a_png(bench_run) -> None:
    pytest.importorskip("matplotlib")
    folder, _ = bench_run
    data = (folder / "latency.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_plots_suffix_picks_its_format(bench_run, tmp_path: Path) -> None:
    """--plot p.svg wrote a PNG under an .svg name; a suffix no format has is refused first."""
    pytest.importorskip("matplotlib")
    from attn_export.report.plot import plot_report

    folder, _ = bench_run
    report = BenchReport.from_dict(json.loads((folder / "bench.json").read_text()))
    plot_report(report, tmp_path / "latency.svg")
    assert b"<svg" in (tmp_path / "latency.svg").read_bytes()[:1000]
    tiny_spec(tmp_path / "models")
    args = ["bench", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, [*args, "--plot", str(tmp_path / "x.txt")])
    assert result.exit_code == 2 and not (tmp_path / "x.txt").exists()
    assert (
        result.output
        == f"Error: --plot {tmp_path / 'x.txt'}: write a .png, .svg, .pdf file (the suffix picks the format)\n"
    )
    assert not (tmp_path / "out").exists()  # refused before anything is built


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    tiny_spec(tmp_path / "models")
    result = CliRunner().invoke(cli, ["bench", "--models", str(tmp_path / "models"), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert result.output == "Error: --plot needs matplotlib, which is not installed (pip install 'attn-export[plot]')\n"
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("64,x", "'64,x' is not a list of sizes like 1,8 or 64,128,...,2048"),
        ("0,4", "'0,4': sizes must be positive integers"),
        ("16,,32", "'16,,32' is not a list of sizes like 1,8 or 64,128,...,2048"),
        ("", "'' is not a list of sizes like 1,8 or 64,128,...,2048"),
    ],
)
def test_bench_bad_size_lists(value: str, message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", "--seq", value])
    assert result.exit_code == 2 and message in result.output


def test_doubling_run_expands() -> None:
    from attn_export.cli.bench import _int_list

    assert _int_list(None, None, "64,128,...,2048") == [64, 128, 256, 512, 1024, 2048]  # type: ignore[arg-type]
    assert _int_list(None, None, "16,8,16") == [16, 8]  # type: ignore[arg-type]  # each row once, in order


def test_bench_refuses_a_graph_the_checker_rejects(bench_run, tmp_path: Path) -> None:
    folder, result = bench_run
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    shutil.copytree(folder / "out", out)
    proto = onnx.load(out / "tiny.onnx")
    proto.graph.node[0].op_type = "NoSuchOp"
    plant(out, "tiny", proto)
    args = ["--models", str(folder / "models"), "--out", str(out), "--seq", "4", "--variant", "fp32", "--no-memory"]
    result = CliRunner().invoke(cli, ["bench", *args, "--budget", "0.01"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: tiny: onnx.checker rejected the graph: ")


@pytest.mark.parametrize("decode", [(), ("--decode",)], ids=["prefill", "decode"])
def test_bench_refuses_jobs_side_by_side_before_building(decode: tuple[str, ...], tmp_path: Path) -> None:
    tiny_spec(tmp_path / "models")
    spec = str(tmp_path / "models" / "tiny.toml")
    result = CliRunner().invoke(cli, ["bench", spec, "--out", str(tmp_path / "out"), *decode, "--jobs", "2"])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        "Error: --jobs 2: every cell here is timed, and timings never run side by side on one machine; "
        "spread them over a cluster's machines with --executor ray"
    )
    assert not (tmp_path / "out").exists()


def _rows(report: dict) -> list[tuple]:
    return [(r["model"], r["runner"], r["batch"], r.get("seq"), r.get("past")) for r in report["rows"]]


@pytest.mark.slow
def test_bench_on_a_local_ray_cluster_gives_the_serial_rows(bench_run, tmp_path: Path) -> None:
    """Every model x shape is a cell, one per node at a time: the rows and their order are
    the serial run's (their figures are timings, which differ run to run)."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    folder, _ = bench_run
    out = tmp_path / "out"
    shutil.copytree(folder / "out", out)
    args = ["--out", str(out), "--batch", "1,2", "--seq", "4,8,...,32", "--variant", "fp32", "--variant", "int8"]
    args += ["--budget", "0.01", "--threads", "1", "--no-memory", "--json", str(tmp_path / "ray.json")]
    spec = str(folder / "models" / "tiny.toml")
    result = CliRunner().invoke(cli, ["bench", spec, *args, "--executor", "ray"])
    assert result.exit_code == 0, result.output
    serial = json.loads((folder / "bench.json").read_text())
    ray = json.loads((tmp_path / "ray.json").read_text())
    assert _rows(ray) == _rows(serial) and len(_rows(ray)) == 4 * 2 * 4
    assert all(r["latency"]["p50_ms"] > 0 for r in ray["rows"])


@pytest.fixture(scope="module")
def compile_run(bench_run) -> tuple[Path, object]:
    """One real torch.compile of the tiny model, timed at two sequence lengths."""
    folder, result = bench_run
    assert result.exit_code == 0, result.output
    args = ["bench", str(folder / "models" / "tiny.toml"), "--out", str(folder / "out"), "--seq", "4,8"]
    args += ["--variant", "fp32", "--compile", "--no-memory", "--budget", "0.01", "--threads", "1"]
    args += ["--json", str(folder / "compile.json"), "--markdown", str(folder / "compile.md")]
    return folder, CliRunner().invoke(cli, [*args, "--benchmark-json", str(folder / "compile-benchmark.json")])


@pytest.mark.slow
def test_compiled_rows_keep_the_compile_time_apart_from_the_latency(compile_run) -> None:
    folder, result = compile_run
    assert result.exit_code == 0, result.output
    report = BenchReport.from_dict(json.loads((folder / "compile.json").read_text()))
    runners = ["torch-eager", "torch-sdpa", "torch-compile", "ort:fp32"]
    assert [(r.runner, r.seq) for r in report.rows] == [(run, s) for s in (4, 8) for run in runners]
    first, second = (r for r in report.rows if r.runner == "torch-compile")
    # seq 4 compiled a graph dynamic in seq, which seq 8 reused; no timed call compiled
    assert first.compile_s is not None and first.compile_s > 0 and second.compile_s == 0.0
    assert first.latency.mean_ms * first.latency.repeats < 1000 * first.compile_s
    assert all(r.compile_s is None for r in report.rows if r.runner != "torch-compile")
    eager = next(r for r in report.rows if (r.runner, r.seq) == ("torch-eager", 4))
    assert first.ratio_to_eager == first.latency.p50_ms / eager.latency.p50_ms and first.flops == eager.flops
    assert report.unavailable == {}
    assert report.to_dict() == BenchReport.from_dict(report.to_dict()).to_dict()
    assert f"compile {first.compile_s:.2f} s" in next(line for line in result.output.splitlines() if "compile" in line)
    markdown = (folder / "compile.md").read_text().splitlines()
    compile_column = [row.split("|")[-3].strip() for row in markdown]
    assert markdown[0].endswith("| % of peak | compile (s) | note |") and compile_column[2] == "-"
    assert compile_column[4] == f"{first.compile_s:.2f}" and compile_column[8] == "0.00"
    entries = custom_smaller_is_better((folder / "compile-benchmark.json").read_text())
    assert f"compile: {first.compile_s:.2f} s (once, not in the value)" in entries[2]["extra"].splitlines()
    assert entries[2]["value"] == first.latency.p50_ms and "compile" not in entries[0]["extra"]


@pytest.mark.slow  # the decode bench's twin of this test runs by default
def test_compile_without_a_cxx_compiler_is_one_line_in_the_report(bench_run, tmp_path: Path) -> None:
    from torch._inductor import config

    folder, result = bench_run
    assert result.exit_code == 0, result.output
    args = ["bench", str(folder / "models" / "tiny.toml"), "--out", str(folder / "out"), "--seq", "4"]
    args += ["--variant", "fp32", "--compile", "--no-memory", "--budget", "0.01", "--json", str(tmp_path / "b.json")]
    with config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        result = CliRunner().invoke(cli, [*args, "--markdown", str(tmp_path / "b.md")])
    assert result.exit_code == 0, result.output
    why = "Inductor needs a C++ compiler and /nonexistent/c++ does not run here (install g++, or name one in CXX)"
    assert f"torch-compile not timed: {why}\n" in result.output
    report = BenchReport.from_dict(json.loads((tmp_path / "b.json").read_text()))
    assert report.unavailable == {"torch-compile": why}
    assert [r.runner for r in report.rows] == ["torch-eager", "torch-sdpa", "ort:fp32"]
    assert (tmp_path / "b.md").read_text().endswith(f"\n\ntorch-compile not timed: {why}\n")


def test_a_prefill_profile_counts_the_profiled_calls_alone(shared_tiny: Built) -> None:
    """The warm-up calls and their nodes stay out of the profile: a call runs the same nodes
    however many are profiled, and every op's share is of the calls' kernel time."""
    spec = load_spec(shared_tiny.models / "tiny.toml")
    feeds = make_feeds(spec, {"batch": 1, "seq": 5, "kv_seq": 7}, 0)
    few, more = (profile_calls(shared_tiny.out / "tiny.onnx", feeds, "cpu", 1, calls=n, warmup=4) for n in (2, 5))
    assert (few.runs, more.runs) == (2, 5)
    assert few.nodes > 0 and few.nodes / 2 == more.nodes / 5
    assert set(few.shares()) == set(few.kernel_us) and "MatMul" in few.kernel_us
    assert sum(more.shares().values()) == pytest.approx(1.0)
    assert list(more.shares().values()) == sorted(more.shares().values(), reverse=True)
    assert 0.0 <= more.outside < 1.0


def _refused_fusion(model: object) -> tuple[object, dict[str, int]]:
    """onnxscript's fusions giving a graph ONNX Runtime refuses (as on nn.MultiheadAttention)."""
    model.graph[0].op_type = "NoSuchOp"  # type: ignore[attr-defined]
    return model, {}


def test_a_default_variant_that_cannot_be_built_is_left_out_with_why(
    bench_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default set's ort-fused failed to build for torch_mha (onnxscript's rewrite), and
    the whole bench exited 1 with no row. Left to the default, it is left out of the model's
    rows and said why; named with --variant, it still fails the run."""
    from onnxscript.rewriter import ort_fusions

    folder, _ = bench_run
    out = tmp_path / "out"
    shutil.copytree(folder / "out", out)
    monkeypatch.setattr(ort_fusions, "optimize_for_ort", _refused_fusion)
    args = ["bench", str(folder / "models" / "tiny.toml"), "--out", str(out), "--seq", "4", "--no-memory"]
    args += ["--budget", "0.01", "--threads", "1"]
    result = CliRunner().invoke(cli, [*args, "--json", str(tmp_path / "bench.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [r["runner"] for r in report["rows"]] == ["torch-eager", "torch-sdpa", "ort:fp32", "ort:int8"]
    assert list(report["unavailable"]) == ["tiny ort:ort-fused"]
    said = "tiny ort:ort-fused not timed: its graph could not be built: tiny.ort-fused: onnx.checker rejected the graph"
    assert said in result.output
    named = CliRunner().invoke(cli, [*args, "--variant", "fp32", "--variant", "ort-fused"])
    assert named.exit_code == 1 and "tiny.ort-fused" in named.output


def test_a_decoders_prefill_sizes_keep_its_sums_and_start_from_the_emptiest_cache() -> None:
    """Every non-batch dim was set to the seq, total_seq too: its mask and its keys
    disagreed and the bench died in a traceback."""
    from attn_export.pipelines.bench.run import _sizes

    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    past = spec.dims["past_seq"].min
    assert _sizes(spec, 2, 8) == {"batch": 2, "seq": 8, "past_seq": past, "total_seq": past + 8}
    # a batch dim named otherwise was timed at the seq and labelled batch 1
    plain = load_spec(TINY_ZOO / "sdpa.toml")
    renamed = dataclasses.replace(plain, dims={"b" if k == "batch" else k: r for k, r in plain.dims.items()})
    with pytest.raises(InputError, match=r"^sdpa: bench needs a dim named 'batch' \(dims: b, seq, kv_seq\)$"):
        _sizes(renamed, 1, 8)


@pytest.mark.slow  # a decoder's build and a bench (15 s); CI runs it
def test_a_decoder_is_benched_as_a_prompt(tmp_path: Path) -> None:
    args = ["bench", str(TINY_ZOO / "mha_kv_cache.toml"), "--out", str(tmp_path / "out"), "--seq", "4,8"]
    result = CliRunner().invoke(cli, [*args, "--variant", "fp32", "--no-memory", "--budget", "0.01", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert [line.split()[:4] for line in result.output.splitlines()[1:5]] == [
        ["mha_kv_cache", runner, "1", seq] for seq in ("4", "8") for runner in ("torch-eager", "ort:fp32")
    ]


@pytest.mark.slow  # an ort-fused build and a bench on two runtimes (20 s); CI runs it
def test_a_default_variant_a_runtime_cannot_load_is_left_out_of_that_runtimes_rows(bench_run, tmp_path: Path) -> None:
    """The reference evaluator has no com.microsoft ops: the default set's ort-fused failed
    the whole run with --runtime onnx-reference, though no one had asked for it."""
    folder, _ = bench_run
    out = tmp_path / "out"
    shutil.copytree(folder / "out", out)
    args = ["bench", str(folder / "models" / "tiny.toml"), "--out", str(out), "--seq", "4", "--no-memory"]
    args += ["--budget", "0.01", "--threads", "1", "--runtime", "onnx-reference", "--runtime", "onnxruntime"]
    result = CliRunner().invoke(cli, [*args, "--json", str(tmp_path / "bench.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    runners = [r["runner"] for r in report["rows"]]
    assert "ort:ort-fused" in runners and "onnx-reference:fp32" in runners and "onnx-reference:ort-fused" not in runners
    assert report["unavailable"]["tiny onnx-reference:ort-fused"].startswith("onnx-reference: cannot load ")


def test_a_row_whose_label_does_not_say_what_it_times_is_told(bench_run) -> None:
    """An int8 that left the graph as it was times the plain graph; an auto row times the
    variant auto chose: neither was said."""
    from attn_export.artifacts.manifest import load_manifest
    from attn_export.pipelines.bench.results import BenchOptions
    from attn_export.pipelines.bench.runners import graph_notes

    folder, _ = bench_run
    manifest = load_manifest(folder / "out")
    spec = load_spec(folder / "models" / "tiny.toml")
    options = BenchOptions(variants=("fp32", "int8"))
    assert graph_notes(manifest, spec, options) == {}
    info = manifest.models["tiny.int8"].variant_info
    info["unchanged"] = "int8 left the graph as it was"
    said = "times the plain graph: int8 left the graph as it was"
    assert graph_notes(manifest, spec, options) == {"tiny ort:int8": said}
    del info["unchanged"]
    info |= {"chosen": "ort-fused", "why": "fastest within the model's tolerance"}
    assert graph_notes(manifest, spec, options) == {
        "tiny ort:int8": "times ort-fused, auto's choice: fastest within the model's tolerance"
    }


@pytest.mark.slow  # a bench run stopped at its limit (3 s)
def test_a_graph_whose_loop_never_ends_fails_bench_in_one_line_at_the_limit(bench_run, tmp_path: Path) -> None:
    """bench timed a graph holding a Loop with no limit: one without end (a folder from
    elsewhere) held it until it was killed. Its first, untimed run is now bounded by
    --region-timeout and fails the run naming the model and runner."""
    folder, result = bench_run
    assert result.exit_code == 0, result.output
    out = Path(shutil.copytree(folder / "out", tmp_path / "out"))
    plant(out, "tiny", endless_loop(onnx.load(out / "tiny.onnx")))
    args = ["bench", str(folder / "models" / "tiny.toml"), "--out", str(out), "--batch", "1", "--seq", "4"]
    args += ["--variant", "fp32", "--budget", "0.01", "--threads", "1", "--region-timeout", "0.5"]
    stopped = CliRunner().invoke(cli, args)
    assert stopped.exit_code == 1, stopped.output
    assert stopped.output.strip().splitlines()[-1] == (
        "Error: tiny ort:fp32: onnxruntime[cpu]: ran past 0.5 s and was stopped (a Loop without end?)"
    )
