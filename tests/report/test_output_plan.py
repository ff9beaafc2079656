"""One output plan per command (``report.outputs.OutputPlan``): every command that writes a
report refuses the same bad targets with the same one-line message (exit 2) before any
work, and leaves them as they were; build and bench refused no report over the external
data of a graph in the folder they make and read, and wrote it over the weights."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.artifacts.files import LOCK_NAME
from attn_export.cli import cli
from attn_export.errors import UsageError
from attn_export.report.output_plan import STDOUT, OutputPlan
from tests.conftest import TINY_ZOO

#: The external data of the folder's mha graph, named .json: list, build and inspect take
#: only a .json file after --json.
DATA = "mha.weights.json"


def _commands(folder: Path, shard: Path) -> dict[str, tuple[list[str], Path | None]]:
    """Each command that writes reports, reading ``folder`` (or ``shard``), as args before
    ``--json TARGET``, and a file it reads that no report may replace (None: it reads none)."""
    graph = str(folder / "mha.onnx")
    bench = ["--variant", "fp32", "--batch", "1", "--seq", "4", "--budget", "0.01", "--no-memory"]
    return {
        "list": (["list", "mha", "--models", str(TINY_ZOO)], None),
        "inspect": (["inspect", graph], folder / DATA),
        "check": (["check", graph], folder / DATA),
        "build": (["build", "mha", "--models", str(TINY_ZOO), "--out", str(folder)], folder / DATA),
        "bench": (["bench", "mha", "--models", str(TINY_ZOO), "--out", str(folder), *bench], folder / DATA),
        "localize": (["localize", str(folder), "mha"], folder / DATA),
        "verify": (["verify", str(folder), "--golden", "--no-latency"], folder / DATA),
        "report merge": (["report", "merge", str(shard)], shard),
    }


@pytest.fixture
def folder(zoo_copy: Path) -> Path:
    """The tiny zoo, its mha graph's weights moved to external data."""
    model = onnx.load(zoo_copy / "mha.onnx")
    onnx.save(model, zoo_copy / "mha.onnx", save_as_external_data=True, location=DATA, size_threshold=0)
    return zoo_copy


@pytest.mark.parametrize("command", list(_commands(Path(), Path())))
def test_every_command_refuses_the_same_targets_in_the_same_words(
    command: str, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    shard = tmp_path / "shard.json"
    shard.write_text("{}")
    args, read = _commands(folder, shard)[command]
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    other = tmp_path / "other"  # a build folder the command does not read
    other.mkdir()
    (other / LOCK_NAME).touch()
    missing = tmp_path / "nowhere" / "r.json"
    said = {
        fifo: f"{fifo} is a FIFO; reports are written only to a regular file or a new path",
        missing: f"cannot write {missing}: no folder {missing.parent}",
        other / "manifest.json": f"--json {other / 'manifest.json'} is manifest.json of the build folder {other}; "
        "write the report elsewhere",
    }
    if read is not None:
        said[read] = f"--json {read} is a file this command reads; write the report elsewhere"
    before = {p: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    for target, why in said.items():
        result = CliRunner().invoke(cli, [*args, "--json", str(target)])
        assert (result.exit_code, result.output) == (2, f"Error: {why}\n"), (command, target)
    assert {p: p.read_bytes() for p in before} == before
    assert not (other / "manifest.json").exists() and not missing.parent.exists()


@pytest.mark.parametrize("command", ["verify", "report merge"])
def test_the_step_summary_is_refused_as_a_report_is(
    command: str, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = tmp_path / "shard.json"
    shard.write_text("{}")
    args, _ = _commands(folder, shard)[command]
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_NAME).touch()
    summary = other / "manifest.json"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = CliRunner().invoke(cli, args)
    why = f"$GITHUB_STEP_SUMMARY {summary} is manifest.json of the build folder {other}; write the report elsewhere"
    assert (result.exit_code, result.output) == (2, f"Error: {why}\n")
    assert not summary.exists()


def test_a_plan_sends_json_to_stdout_or_files_and_checks_before_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    junit = tmp_path / "r.xml"
    plan = OutputPlan.make({"json": STDOUT, "junit": junit, "markdown": None})
    assert plan == OutputPlan({"junit": junit}, to_stdout=True)
    plan.echo("text")  # --json - holds stdout
    plan.write_texts({"json": lambda: "{}\n", "junit": lambda: "<xml/>", "markdown": lambda: pytest.fail("not asked")})
    assert capsys.readouterr().out == "{}\n" and junit.read_text() == "<xml/>"
    with pytest.raises(UsageError, match=r"^--json and --junit both name"):
        OutputPlan.make({"json": junit, "junit": junit})
    with pytest.raises(UsageError, match=r"is a file this command reads"):
        OutputPlan.make({"json": tmp_path / "in.json"}, reads=[tmp_path / "in.json"])
