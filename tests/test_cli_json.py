"""One meaning of --json for every command: ``--json FILE`` writes FILE, ``--json -`` puts
the JSON on stdout in place of the text; list, build and inspect also take a bare ``--json``
(stdout), and there the value must be a .json file, so that the next word (a model's name,
a graph) is never written over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from onnx import TensorProto, helper, save

from attn_export.cli import cli
from tests.conftest import TINY_ZOO, shared_build


def _strict(text: str) -> object:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(cli, list(args))


def test_list_prints_json_with_a_bare_json_or_a_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = str(TINY_ZOO)
    bare = _run(tmp_path, monkeypatch, "list", "mha", "--models", models, "--json")
    dash = _run(tmp_path, monkeypatch, "list", "--json", "-", "mha", "--models", models)
    assert bare.exit_code == dash.exit_code == 0, bare.output + dash.output
    assert bare.stdout == dash.stdout and [s["name"] for s in _strict(bare.stdout)] == ["mha"]  # type: ignore[union-attr]


def test_list_writes_a_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _run(tmp_path, monkeypatch, "list", "--json", "specs.json", "mha", "--models", str(TINY_ZOO))
    assert done.exit_code == 0, done.output
    assert "mha" in done.stdout  # the table, as without --json
    assert [s["name"] for s in _strict((tmp_path / "specs.json").read_text())] == ["mha"]  # type: ignore[union-attr]


@pytest.mark.parametrize("command", [["list"], ["build"], ["inspect", "g.onnx"]])
def test_a_bare_json_never_writes_over_the_word_after_it(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``list --json mha`` would otherwise write the specs to a file named mha."""
    name, *rest = command
    done = (
        _run(tmp_path, monkeypatch, name, "--json", "mha", *rest, "--models", str(TINY_ZOO))
        if name != "inspect"
        else _run(tmp_path, monkeypatch, name, *rest, "--json", "mha")
    )
    assert done.exit_code == 2
    assert "'mha' is not a .json file. --json takes the word after it as its file" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _graph(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_check_json_dash_puts_only_json_on_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = str(_graph(tmp_path / "g.onnx"))
    to_file = _run(tmp_path, monkeypatch, "check", graph, "--json", "report.json")
    to_stdout = _run(tmp_path, monkeypatch, "check", graph, "--json", "-")
    assert to_file.exit_code == to_stdout.exit_code == 0
    assert to_file.stdout and to_file.stdout != to_stdout.stdout  # the text, and the JSON in its place
    doc, saved = _strict(to_stdout.stdout), _strict((tmp_path / "report.json").read_text())
    assert isinstance(doc, dict) and isinstance(saved, dict) and doc["passed"] is saved["passed"] is True
    assert [f["path"] for f in doc["files"]] == [f["path"] for f in saved["files"]] == [graph]


def test_a_file_named_dash_is_written_as_dot_slash_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _run(tmp_path, monkeypatch, "check", str(_graph(tmp_path / "g.onnx")), "--json", "./-")
    assert done.exit_code == 0 and not done.stdout.lstrip().startswith("{")
    _strict((tmp_path / "-").read_text())


def test_inspect_json_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = str(_graph(tmp_path / "g.onnx"))
    bare = _run(tmp_path, monkeypatch, "inspect", graph, "--json")
    to_file = _run(tmp_path, monkeypatch, "inspect", "--json", "g.json", graph)
    assert bare.exit_code == to_file.exit_code == 0
    assert _strict(bare.stdout) == _strict((tmp_path / "g.json").read_text())
    assert "Relu" in to_file.stdout and not to_file.stdout.startswith("{")


def test_build_refuses_json_over_its_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _run(
        tmp_path, monkeypatch, "build", "mha", "--models", str(TINY_ZOO), "--json", "out/manifest.json", "--out", "out"
    )
    assert done.exit_code == 2
    assert "--json out/manifest.json is manifest.json of the build folder out" in done.stderr


def test_verify_json_dash_is_the_report_alone(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = shared_build(tmp_path_factory, "json-mha", [TINY_ZOO / "mha.toml"])
    args = ["verify", str(built.out), "--golden", "--no-latency"]
    to_stdout = _run(tmp_path, monkeypatch, *args, "--json", "-")
    to_file = _run(tmp_path, monkeypatch, *args, "--json", "report.json")
    assert to_stdout.exit_code == to_file.exit_code == 0, to_stdout.output
    assert "verify PASSED" in to_file.stdout and "verify PASSED" not in to_stdout.stdout
    doc, saved = _strict(to_stdout.stdout), _strict((tmp_path / "report.json").read_text())
    assert isinstance(doc, dict) and isinstance(saved, dict) and doc["summary"] == saved["summary"]
