"""The GitHub Action (action.yml): its `run:` steps, read from action.yml with `${{ ... }}`
substituted as the runner would, run in bash with a fake runner environment (GITHUB_OUTPUT,
GITHUB_STEP_SUMMARY, GITHUB_WORKSPACE, ...) on a tiny build; the outputs, the summary and
the exit code are checked as a workflow would see them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml

from attn_export import github_action
from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.golden import read_golden, write_golden
from attn_export.artifacts.manifest import SCHEMA
from attn_export.github_action import DEFAULTS, ActionInputs, run_action, verify_command
from attn_export.runtimes.ort import available_providers
from tests.conftest import ROOT, Built, copy_build, endless_loop, key_scale_off, needs_transformers, plant, tiny_spec

ACTION = yaml.safe_load((ROOT / "action.yml").read_text())
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def _substitute(text: str, context: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        assert match[1] in context, f"action.yml uses ${{{{ {match[1]} }}}}, which the runner here does not provide"
        return context[match[1]]

    return EXPRESSION.sub(value, text)


def parse_github_output(text: str) -> dict[str, str]:
    """``$GITHUB_OUTPUT`` as the runner reads it: ``name=value`` lines and ``name<<DELIM`` blocks."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        name, sep, delimiter = lines[i].partition("<<")
        if sep and "=" not in name:
            end = lines.index(delimiter, i + 1)
            out[name] = "\n".join(lines[i + 1 : end])
            i = end + 1
        else:
            name, _, value = lines[i].partition("=")
            out[name] = value
            i += 1
    return out


@dataclass
class ActionRun:
    code: int
    log: str
    outputs: dict[str, str]
    summary: str


def run_action_steps(tmp_path: Path, inputs: dict[str, str]) -> ActionRun:
    """Run action.yml's steps as a composite action runs them: each ``run:`` step in
    ``bash --noprofile --norc -eo pipefail`` in the workspace with its own GITHUB_OUTPUT, a
    ``uses:`` step skipped (its ``if:`` is false without python-version), the first failing
    step ending the action; the action's outputs resolved from the steps' outputs."""
    declared = ACTION["inputs"]
    assert set(inputs) <= set(declared), set(inputs) - set(declared)
    context = {f"inputs.{name}": inputs.get(name, str(spec.get("default", ""))) for name, spec in declared.items()}
    workspace, runner = tmp_path / "workspace", tmp_path / "runner"
    workspace.mkdir()
    runner.mkdir()
    python_bin = Path(sys.executable).parent
    assert (python_bin / "python").exists(), "the steps call `python`: the test's interpreter must be on PATH as one"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "RUNNER_", "ATTN_EXPORT_"))}
    env |= {
        "PATH": f"{python_bin}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        "CI": "true",
        "GITHUB_ACTIONS": "true",
        "GITHUB_ACTION_PATH": str(ROOT),
        "GITHUB_WORKSPACE": str(workspace),
        "GITHUB_STEP_SUMMARY": str(runner / "summary.md"),
        "RUNNER_TEMP": str(runner),
    }
    assert ACTION["runs"]["using"] == "composite"
    log, code = [], 0
    for k, step in enumerate(ACTION["runs"]["steps"]):
        if "uses" in step:
            assert step["uses"].startswith("actions/setup-python@") and step["if"] == "inputs.python-version != ''"
            assert not inputs.get("python-version")
            continue
        assert step["shell"] == "bash" and "if" not in step, step
        output = runner / f"output-{k}"
        output.touch()
        script = runner / f"step-{k}.sh"
        script.write_text(_substitute(step["run"], context))
        step_env = {name: _substitute(str(value), context) for name, value in step.get("env", {}).items()}
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            env=env | step_env | {"GITHUB_OUTPUT": str(output)},
            cwd=workspace,
            capture_output=True,
            text=True,
        )
        log.append(done.stdout + done.stderr)
        for name, value in parse_github_output(output.read_text()).items():
            context[f"steps.{step.get('id')}.outputs.{name}"] = value
        if done.returncode:
            code = done.returncode
            break
    outputs = {
        name: _substitute(spec["value"], _unset(spec["value"]) | context) for name, spec in ACTION["outputs"].items()
    }
    summary = (runner / "summary.md").read_text() if (runner / "summary.md").exists() else ""
    return ActionRun(code, "".join(log), outputs, summary)


def _unset(text: str) -> dict[str, str]:
    """A step output no step set reads as empty, as on the runner."""
    return {m[1]: "" for m in EXPRESSION.finditer(text) if m[1].startswith("steps.")}


def _golden_inputs(built: Built, **more: str) -> dict[str, str]:
    return {"build-dir": str(built.out), "golden": "true", "shard": "1/2", **more}


def test_the_action_passes_a_sound_build(tiny_build: Built, tmp_path: Path) -> None:
    run = run_action_steps(tmp_path, _golden_inputs(tiny_build))
    assert run.code == 0, run.log
    assert "using the installed attn-export 0." in run.log
    reports = tmp_path / "workspace" / "attn-export-reports"
    assert run.outputs == {
        "json": str(reports / "shard-1-of-2.json"),
        "junit": str(reports / "shard-1-of-2.xml"),
        "markdown": str(reports / "shard-1-of-2.md"),
        "passed": "true",
    }
    report = json.loads(Path(run.outputs["json"]).read_text())
    assert report["passed"] is True and report["settings"]["golden"] is True
    assert [c["model"] for c in report["checks"]] == ["tiny"]
    assert ET.parse(run.outputs["junit"]).getroot().find("testsuite").get("failures") == "0"  # type: ignore[union-attr]
    markdown = Path(run.outputs["markdown"]).read_text()
    assert run.summary == markdown + "\nattn-export verify passed; fail-on: numerics.\n"


def test_a_failing_verify_fails_the_step_with_passed_false(tiny_build: Built, tmp_path: Path) -> None:
    golden = tiny_build.out / "tiny.golden.npz"
    cases = read_golden(golden)
    cases[0].outputs["output"] = cases[0].outputs["output"] + np.float32(1.0)  # PyTorch's answer, doctored
    write_golden(golden, cases)
    manifest = json.loads((tiny_build.out / "manifest.json").read_text())
    manifest["models"]["tiny"]["golden_sha256"] = sha256_file(golden)  # recorded as a build would: numbers differ
    (tiny_build.out / "manifest.json").write_text(json.dumps(manifest))
    run = run_action_steps(tmp_path, _golden_inputs(tiny_build))
    assert run.code == 1, run.log
    assert run.outputs["passed"] == "false" and Path(run.outputs["json"]).is_file()
    report = json.loads(Path(run.outputs["json"]).read_text())
    failed = [c for c in report["cases"] if not c["passed"]]
    assert failed and all(c["comparisons"][0]["max_abs_error"] >= 0.99 for c in failed), failed
    assert run.summary.startswith("### attn-export verify: ❌ failed")
    assert run.summary.endswith("`\n\nattn-export verify failed (exit 1); fail-on: numerics.\n")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"FAIL_ON": "numerics speed"}, "input fail-on: speed unknown (choose from numerics, latency, placement)"),
        ({"REPORTS_DIR": "pyproject.toml"}, "input reports-dir: cannot make pyproject.toml: File exists"),
        # verify printed its help and the step passed, having checked nothing
        ({"BUILD_DIR": "--help"}, "input build-dir: '--help' reads as an option, not a folder (name it ./--help)"),
        ({"MODELS": "-h"}, "input models: '-h' reads as an option, not a folder (name it ./-h)"),
        pytest.param(
            {"PROVIDERS": "cpu cuda"},
            "provider 'cuda' is not available in this onnxruntime; available: ",
            marks=pytest.mark.skipif("cuda" in available_providers(), reason="CUDA is here"),
        ),  # it built first, and verify's exit 2 had no ::error:: line
    ],
)
def test_bad_input_is_one_error_line_exit_2_and_passed_false(
    given: dict[str, str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(ROOT)
    env = {f"ATTN_EXPORT_{k}": v for k, v in given.items()}
    env |= {"GITHUB_OUTPUT": str(tmp_path / "out"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    assert run_action(env) == 2
    said = capsys.readouterr().out
    assert said.startswith(f"::error title=attn-export::{message}") and said.count("\n") == 1, said
    outputs = parse_github_output((tmp_path / "out").read_text())
    assert outputs == {"json": "", "junit": "", "markdown": "", "passed": "false"}
    assert (tmp_path / "summary.md").read_text().startswith(f"\n### attn-export: ❌ bad input\n\n{message}")


@pytest.mark.parametrize("variable", ["GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"])
@pytest.mark.parametrize("kind", ["a directory", "a FIFO", "a character device"])
def test_a_runner_file_that_is_no_file_is_one_error_line_exit_2(
    variable: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback, after the build and verify had run."""
    monkeypatch.chdir(tmp_path)
    special = {"a directory": tmp_path / "dir", "a FIFO": tmp_path / "fifo", "a character device": Path(os.devnull)}
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setattr(github_action, "_attn_export", lambda args: pytest.fail("nothing runs"))
    env = {"GITHUB_OUTPUT": str(tmp_path / "out"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    assert run_action(env | {variable: str(special[kind])}) == 2
    assert capsys.readouterr().out == (
        f"::error title=attn-export::${variable}: {special[kind]} is {kind}; "
        "reports are written only to a regular file or a new path\n"
    )


@pytest.mark.parametrize("variable", ["GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"])
@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("other/manifest.json", "is manifest.json of the build folder"),
        ("other/mha.golden.npz", ": .npz is a golden file's suffix, not a report's"),
        ("models/mha.toml", ": .toml is a spec's suffix, not a report's"),
    ],
)
def test_a_runner_file_that_is_a_build_or_spec_file_is_refused_and_left_as_it_was(
    variable: str,
    name: str,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The step appended its outputs to whatever the variable named: a build's manifest
    became invalid JSON, a golden file no zip, and the next verify failed."""
    monkeypatch.chdir(tmp_path)
    for folder in ("other", "models"):  # a build folder besides the one the step makes
        (tmp_path / folder).mkdir()
    (tmp_path / "other" / "manifest.json").write_text(f'{{"schema": "{SCHEMA}", "models": {{}}}}')
    (tmp_path / "other" / "mha.golden.npz").write_bytes(b"PK")
    (tmp_path / "models" / "mha.toml").write_text('module = "m:M"')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.setattr(github_action, "_attn_export", lambda args: pytest.fail("nothing runs"))
    env = {"GITHUB_OUTPUT": str(tmp_path / "out"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    assert run_action(env | {variable: str(tmp_path / name)}) == 2
    said = capsys.readouterr().out
    assert said.startswith(f"::error title=attn-export::${variable} {tmp_path / name}") and says in said, said
    assert said.count("\n") == 1 and {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("variable", ["GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"])
def test_a_runner_file_inside_the_build_folder_the_step_makes_is_refused(
    variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the step's build the folder holds nothing a report's rules know: the step
    appended its outputs to the manifest the build then wrote."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(github_action, "_attn_export", lambda args: pytest.fail("nothing runs"))
    env = {"GITHUB_OUTPUT": str(tmp_path / "out"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    (tmp_path / "made").mkdir()  # the runner makes its files' folder; the build has not run yet
    env |= {"ATTN_EXPORT_BUILD_DIR": "made", variable: str(tmp_path / "made" / "manifest.json")}
    assert run_action(env) == 2
    said = capsys.readouterr().out
    where = tmp_path / "made" / "manifest.json"
    assert (
        said == f"::error title=attn-export::${variable} {where} is inside the build folder made; point it elsewhere\n"
    )
    assert not any((tmp_path / "made").iterdir())


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"PROVIDERS": "cpu,tpu"}, "input providers: tpu unknown (choose from "),
        ({"SHARD": "3/2"}, "input shard: '3/2' is not i/n with 1 <= i <= n (e.g. 2/4)"),
        ({"GOLDEN": "yes"}, "input golden: 'yes' is neither true nor false"),
        ({"MAX_SLOWDOWN": "nan"}, "input max-slowdown: 'nan' is not a finite number."),
        ({"MAX_SLOWDOWN": "0"}, "input max-slowdown: 0.0 is not in the range x>0."),
        ({"REGIONS": "loud"}, "input regions: loud unknown (choose from check, strict, or empty)"),
        ({"REGION_TIMEOUT": "soon"}, "input region-timeout: give seconds above 0 and at most 86400, not 'soon'"),
        ({"REGION_TIMEOUT": "1e6"}, "input region-timeout: give seconds above 0 and at most 86400, not '1e6'"),
    ],
)
def test_each_input_is_checked_before_anything_runs(given: dict[str, str], message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        ActionInputs.from_env({f"ATTN_EXPORT_{k}": v for k, v in given.items()})


def test_the_defaults_are_action_yml_s() -> None:
    declared = {name: str(spec.get("default", "")) for name, spec in ACTION["inputs"].items()}
    assert {name: value for name, value in declared.items() if name != "python-version"} == DEFAULTS


def test_a_report_an_earlier_run_left_is_never_this_run_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # no spec: the build fails before verify writes anything
    stale = tmp_path / "attn-export-reports" / "verify.json"
    stale.parent.mkdir()
    stale.write_text("{}")
    env = {"ATTN_EXPORT_MODELS": "models", "GITHUB_OUTPUT": str(tmp_path / "out")}
    assert run_action(env) != 0
    outputs = parse_github_output((tmp_path / "out").read_text())
    assert outputs == {"json": "", "junit": "", "markdown": "", "passed": "false"} and not stale.exists()


def test_fail_on_maps_each_gate_to_its_verify_option() -> None:
    env = {"ATTN_EXPORT_FAIL_ON": "placement, latency", "ATTN_EXPORT_PROVIDERS": "cpu cuda", "ATTN_EXPORT_SHARD": "2/4"}
    inputs = ActionInputs.from_env(env)
    assert inputs.fail_on == ("numerics", "latency", "placement")
    assert verify_command(inputs) == [
        "verify", "build", "--models", "models", "--provider", "cpu", "--provider", "cuda", "--shard", "2/4",
        "--json", "attn-export-reports/shard-2-of-4.json",
        "--junit", "attn-export-reports/shard-2-of-4.xml",
        "--markdown", "attn-export-reports/shard-2-of-4.md",
        "--max-slowdown", "2", "--require-placement",
    ]  # fmt: skip
    assert "--max-slowdown" not in verify_command(ActionInputs.from_env({}))


@pytest.mark.slow
def test_the_action_builds_and_verifies_against_pytorch(tmp_path: Path) -> None:
    models = tmp_path / "workspace-models"
    tiny_spec(models, exporter="torchscript")
    inputs = {"models": str(models), "build-dir": "build", "fail-on": "latency", "max-slowdown": "1000"}
    run = run_action_steps(tmp_path, inputs)
    assert run.code == 0, run.log
    assert "::group::attn-export build" in run.log and "--max-slowdown 1000" in run.log
    report: dict[str, Any] = json.loads(Path(run.outputs["json"]).read_text())
    assert report["passed"] and report["settings"]["max_slowdown"] == 1000 and report["settings"]["golden"] is False
    assert (tmp_path / "workspace" / "build" / "tiny.onnx").is_file()


def test_the_docs_workflows_use_only_the_action_s_inputs_and_its_report_names() -> None:
    page = (ROOT / "docs" / "ci.md").read_text()
    steps = [
        step
        for block in re.findall(r"```yaml\n(.*?)```", page, re.S)
        for doc in [yaml.safe_load(block)]
        for step in (
            doc if isinstance(doc, list) else [s for job in doc.get("jobs", {}).values() for s in job["steps"]]
        )
        if isinstance(step, dict) and "attn-export@" in str(step.get("uses", ""))
    ]
    assert len(steps) == 2
    for step in steps:
        assert set(step["with"]) <= set(ACTION["inputs"]), set(step["with"]) - set(ACTION["inputs"])
    # The matrix shards upload shard-<i>-of-4.json, which the merge job's glob takes.
    shard = ActionInputs.from_env({"ATTN_EXPORT_SHARD": "3/4"})
    assert Path(verify_command(shard)[verify_command(shard).index("--json") + 1]).name == "shard-3-of-4.json"
    assert "attn-export report merge shard-*.json --junit " in page


def test_a_verify_that_refuses_its_input_is_an_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inputs only verify can judge (a stale build, a folder without graphs) end it with exit 2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(github_action, "_attn_export", lambda args: 2 if args[0] == "verify" else 0)
    env = {"GITHUB_OUTPUT": str(tmp_path / "out"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    assert run_action(env) == 2
    assert "::error title=attn-export::verify refused its input (exit 2); the step's log says why\n" in (
        capsys.readouterr().out
    )
    assert parse_github_output((tmp_path / "out").read_text())["passed"] == "false"


def test_regions_becomes_verify_s_region_option() -> None:
    assert verify_command(ActionInputs.from_env({"ATTN_EXPORT_REGIONS": "strict"}))[-1] == "--strict-regions"
    assert not [a for a in verify_command(ActionInputs.from_env({})) if a.endswith("-regions")]


def test_region_timeout_bounds_each_run_of_a_graph_holding_a_loop(tiny_build: Built, tmp_path: Path) -> None:
    """A graph's Loop ran bounded at verify's 120 s and the action could not change it."""
    plant(tiny_build.out, "tiny", endless_loop(onnx.load(tiny_build.out / "tiny.onnx")))
    run = run_action_steps(tmp_path, _golden_inputs(tiny_build, **{"region-timeout": "0.5"}))
    assert run.code == 1 and "ran past 0.5 s and was stopped (a Loop without end?)" in run.log, run.log
    assert json.loads(Path(run.outputs["json"]).read_text())["settings"]["region_timeout"] == 0.5


@needs_transformers
@pytest.mark.slow  # two verifies of BERT's sweeps, plain and int8, each localizing both (over a minute)
def test_the_action_s_regions_note_or_fail_a_region_over_its_tolerance(
    shared_bert: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 graph's key projection a quarter off passes verify; ``regions: check`` notes
    it in the step's log and report, ``strict`` fails the step on it; the plain graph beside
    it has neither."""
    copy = copy_build(shared_bert, tmp_path / "given")
    key_scale_off(copy.out, "bert_attention.int8", 1.25)
    inputs = {"models": str(copy.models), "build-dir": str(copy.out), "regions": "check"}
    run = run_action_steps(tmp_path, inputs)
    said = "bert_attention.int8: outputs agree, but region linear_1 ("
    assert run.code == 0 and run.outputs["passed"] == "true", run.log
    (note,) = [line for line in run.log.splitlines() if line.startswith("note: ") and "region" in line]
    assert note.startswith(f"note: {said}") and "--check-regions" in run.log
    checks = {c["model"]: c for c in json.loads(Path(run.outputs["json"]).read_text())["checks"]}
    assert checks["bert_attention.int8"]["notes"] == [note.removeprefix("note: ")]
    assert checks["bert_attention"]["notes"] == [] and checks["bert_attention"]["passed"]
    monkeypatch.chdir(tmp_path / "workspace")
    env = {f"ATTN_EXPORT_{k.upper().replace('-', '_')}": v for k, v in {**inputs, "regions": "strict"}.items()}
    assert run_action(env | {"GITHUB_OUTPUT": str(tmp_path / "strict-outputs")}) == 1
    checks = {c["model"]: c for c in json.loads(Path("attn-export-reports/verify.json").read_text())["checks"]}
    assert checks["bert_attention.int8"]["problems"][0].startswith(said)
    assert checks["bert_attention"]["passed"] and not checks["bert_attention"]["problems"]
