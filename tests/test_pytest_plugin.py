"""The pytest plugin, run as a user runs it: pytest in a subprocess on a throwaway project
with one good model, one planted failure and a test of its own using assert_onnx_matches."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.model_spec import load_spec
from attn_export.model_spec.distributions import case_label
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, case_plan
from tests.conftest import (
    TINY_MHA,
    Built,
    copy_build,
    endless_loop,
    key_scale_off,
    needs_transformers,
    plant,
    write_spec,
)

OWN_TEST = """
import torch

from attn_export import assert_onnx_matches
from attn_export.zoo.seed import MultiHeadAttention


def test_my_graph_matches_my_module():
    torch.manual_seed(0)  # the spec's seeded weights
    module = MultiHeadAttention(hidden_dim=16, num_heads=2)
    dims = {"batch": (1, 4), "seq": (1, 24), "kv_seq": (1, 40)}
    assert_onnx_matches(module, "build/good.onnx", dims=dims)
"""


@pytest.mark.slow
def test_plugin_collects_every_case_and_fails_only_the_planted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchscript, the fastest exporter: what is tested here is not the export
    body = TINY_MHA.replace("{exporter}", "torchscript")
    specs = [write_spec(tmp_path / "models", "good", body), write_spec(tmp_path / "models", "bad", body)]
    out = tmp_path / "build"
    assert build_models(specs, BuildOptions(out)).exit_code == 0
    ref = tmp_path / "ref"
    build_models([write_spec(tmp_path / "other", "bad", body + "\n[weights]\nseed = 1\n")], BuildOptions(ref))
    plant(out, "bad", (ref / "bad.onnx").read_bytes())  # a graph of other weights, hash fixed up
    (tmp_path / "test_mine.py").write_text(OWN_TEST)

    args = [sys.executable, "-m", "pytest", "--attn-export", "build", "-p", "no:cacheprovider", "-rf", "-q"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)
    output = done.stdout
    assert done.returncode == 1, output + done.stderr
    plan = [case_label(p.label, d) for p, d in case_plan(load_spec(specs[1]), VerifyOptions())]
    failed = sorted(re.findall(r"^FAILED build/manifest.json::(\S+)", output, re.M))
    unit_normal = ("min", "distinct", "max", "skew-a", "skew-b", "random-0", "random-1")
    assert {f"bad[onnxruntime-cpu-{c}]" for c in unit_normal} <= set(failed)
    assert set(failed) <= {f"bad[onnxruntime-cpu-{c}]" for c in plan}  # every case of good passes
    passed = 2 * len(plan) + 1 - len(failed)  # each model's cases, and the own test
    assert output.strip().splitlines()[-1].startswith(f"{len(failed)} failed, {passed} passed in ")
    assert re.search(r"outside atol=1\.\d+e-05 rtol=0.0001; max abs \d", output)  # the numbers (atol with its floor)
    # once per failure; the short summary repeats whole messages where pytest detects CI
    failures = output.split("short test summary info")[0]
    reproduce = re.findall(r"^reproduce: (attn-export verify .*)$", failures, re.M)
    assert len(reproduce) == len(failed)
    monkeypatch.chdir(tmp_path)  # where pytest ran: the project's models/ folder
    again = CliRunner().invoke(cli, shlex.split(reproduce[0])[1:])  # the command reproduces the failure
    assert again.exit_code == 1 and "FAIL bad onnxruntime[cpu]" in again.output


@pytest.fixture
def one_model(tmp_path: Path) -> Path:
    spec = write_spec(tmp_path / "models", "good", TINY_MHA.replace("{exporter}", "torchscript"))
    assert build_models([spec], BuildOptions(tmp_path / "build")).exit_code == 0
    return tmp_path


def _pytest(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "pytest", "--attn-export", "build", "-p", "no:cacheprovider", "-q", *extra]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_plugin_turns_every_error_into_a_one_line_failure_or_usage_error(one_model: Path) -> None:
    plant(one_model / "build", "good", b"not a graph")  # corrupt, its hash fixed up: it reaches the loader
    corrupt = _pytest(one_model)
    assert corrupt.returncode == 1 and "Traceback" not in corrupt.stdout and "INTERNALERROR" not in corrupt.stdout
    assert "good.onnx: not an ONNX model (does not parse as a ModelProto" in corrupt.stdout
    assert len(corrupt.stdout.splitlines()) < 30 * corrupt.stdout.count("FAILED")  # short failures, no tracebacks

    seed = _pytest(one_model, "--attn-export-seed", "-1")
    assert seed.returncode == 4 and "--attn-export-seed -1: a seed is 0 or more" in seed.stderr
    assert "Traceback" not in seed.stdout + seed.stderr


def test_a_build_folder_that_is_a_loop_of_symbolic_links_is_a_usage_error(tmp_path: Path) -> None:
    """It was INTERNALERROR and a traceback: Python raises RuntimeError on such a loop."""
    (tmp_path / "build").symlink_to("build")
    loop = _pytest(tmp_path)
    assert loop.returncode == 4 and "INTERNALERROR" not in loop.stdout + loop.stderr, loop.stdout + loop.stderr
    assert "ERROR: --attn-export: build: refused: a loop of symbolic links" in loop.stderr


@pytest.mark.slow
def test_the_plugin_has_a_budget_and_fails_a_case_over_it_in_one_line(
    one_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    over = _pytest(one_model, "--attn-export-max-memory", "16KiB")
    assert over.returncode == 1 and "INTERNALERROR" not in over.stdout, over.stdout
    assert "over the memory budget of 16.0 KiB" in over.stdout
    # the model's line reruns it under the same budget (it left the budget out, and passed)
    found = re.search(r"^reproduce: (attn-export verify \S+ .*)$", over.stdout, re.M)
    assert found and found.group(1).endswith(" --seed 0 --max-memory 16384 --no-latency"), over.stdout
    monkeypatch.chdir(one_model)  # where pytest ran
    again = CliRunner().invoke(cli, shlex.split(found.group(1))[1:])
    assert again.exit_code == 2 and "over the memory budget of 16.0 KiB" in again.output, again.output
    bad = _pytest(one_model, "--attn-export-max-memory", "lots")
    assert bad.returncode == 4 and "--attn-export-max-memory: 'lots' is not a memory size" in bad.stderr


def test_the_cases_are_collected_counted_and_selected_as_any_test(
    one_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The cases were added after collection: pytest said "collected 0 items" (-k: "-12
    selected"), and two folders outside the rootdir gave one node id, without their folder."""
    n = len(case_plan(load_spec(one_model / "models" / "good.toml"), VerifyOptions()))
    args = ["--attn-export", str(one_model / "build"), "--attn-export-models", str(one_model / "models")]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "--collect-only", "-k", "min"],
        cwd=tmp_path_factory.mktemp("elsewhere"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and f"1/{n} tests collected ({n - 1} deselected)" in done.stdout, done.stdout
    assert done.stdout.startswith(f"{one_model.name}/build/manifest.json::good[onnxruntime-cpu-min]\n")


def test_a_bad_regions_option_is_a_usage_error_naming_the_plugin_s_flag(one_model: Path) -> None:
    bad = _pytest(one_model, "--attn-export-regions", "loud")
    assert bad.returncode == 4 and "--attn-export-regions 'loud': give one of check, strict" in bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


@pytest.mark.slow  # two pytest runs in subprocesses, one stopped at its limit (8 s)
def test_a_run_limit_reaches_the_runtime_and_a_bad_one_is_a_usage_error(one_model: Path) -> None:
    """A graph holding a Loop ran each case bounded at 120 s, with no way to change it from
    the plugin: --attn-export-region-timeout sets the bound, as verify --region-timeout."""
    plant(one_model / "build", "good", endless_loop(onnx.load(one_model / "build" / "good.onnx")))
    stopped = _pytest(one_model, "--attn-export-region-timeout", "0.5", "-x")
    assert stopped.returncode == 1 and "ran past 0.5 s and was stopped (a Loop without end?)" in stopped.stdout
    assert "--region-timeout 0.5" in stopped.stdout  # its reproduce line runs the same bound
    bad = _pytest(one_model, "--attn-export-region-timeout", "0")
    assert bad.returncode == 4 and "--attn-export-region-timeout: give seconds above 0" in bad.stderr, bad.stderr


@needs_transformers
@pytest.mark.slow  # two pytest runs over BERT's sweeps, plain and int8, each localizing both (over a minute)
def test_the_plugin_s_regions_warn_of_or_fail_a_region_over_its_tolerance(shared_bert: Built, tmp_path: Path) -> None:
    """The int8 graph's key projection a quarter off passes verify; --attn-export-regions
    check makes it a Notice warning, strict fails its cases; the plain graph beside it has
    neither."""
    copy = copy_build(shared_bert, tmp_path)
    key_scale_off(copy.out, "bert_attention.int8", 1.25)
    args = [sys.executable, "-m", "pytest", "--attn-export", str(copy.out), "--attn-export-models", str(copy.models)]
    args += ["-p", "no:cacheprovider", "-q", "-rf", "--attn-export-regions"]
    said = "bert_attention.int8: outputs agree, but region linear_1 ("
    noted = subprocess.run([*args, "check"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert noted.returncode == 0 and f"Notice: {said}" in noted.stdout, noted.stdout + noted.stderr
    assert noted.stdout.count("Notice: ") == 1 and "modeling_bert.py:" in noted.stdout
    strict = subprocess.run([*args, "strict"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    failed = re.findall(r"^FAILED \S+::(\S+?)\[", strict.stdout, re.M)
    assert strict.returncode == 1 and failed and set(failed) == {"bert_attention.int8"}, strict.stdout
    assert f"FAIL {said}" in strict.stdout and "Notice: " not in strict.stdout


@pytest.mark.slow  # a decoder's build and a pytest run of its sweep (15 s)
def test_a_failing_decode_trajectory_says_the_command_that_reruns_it(tmp_path: Path) -> None:
    """A trajectory's failure named its step but no command: a case's had one."""
    from attn_export.exporter.factory import instantiate
    from attn_export.exporter.torch_export import export_onnx
    from attn_export.model_spec.inputs import make_feeds
    from attn_export.model_spec.shapes import example_sizes
    from tests.conftest import TINY_ZOO
    from tests.faulty_decoders import SafeSoftmaxOnly

    spec_file = TINY_ZOO / "mha_kv_cache.toml"
    assert build_models([spec_file], BuildOptions(tmp_path / "build")).exit_code == 0
    spec = load_spec(spec_file)
    faulty = SafeSoftmaxOnly(**spec.kwargs).eval()
    faulty.load_state_dict(instantiate(spec).state_dict())  # gives PyTorch's 0 on a row with no key: no graph does
    plant(
        tmp_path / "build",
        "mha_kv_cache",
        export_onnx(faulty, spec, make_feeds(spec, example_sizes(spec), 0), opset=18),
    )
    done = _pytest(tmp_path, "--attn-export-models", str(TINY_ZOO), "-k", "left", "-rf")
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.findall(r"^FAILED \S+::(\S+)", done.stdout, re.M) == ["mha_kv_cache[onnxruntime-cpu-decode-left-padded]"]
    command = re.search(r"^reproduce: (attn-export verify .*--decode 8 --seed 0 --no-latency)$", done.stdout, re.M)
    assert command, done.stdout
    again = CliRunner().invoke(cli, shlex.split(command.group(1))[1:])
    assert again.exit_code == 1 and "FAIL mha_kv_cache onnxruntime[cpu] decode left-padded: first divergence" in (
        again.output
    )
