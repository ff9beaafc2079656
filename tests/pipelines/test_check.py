"""check: the static checks pass a sound build, and each planted fault fails its own check
and no other; bad usage is one line and exit 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from attn_export.cli import cli
from attn_export.pipelines.check import CHECKS, CheckReport, check_paths
from tests.conftest import ROOT, Built, plant


def _check(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["check", *map(str, args)])
    return result.exit_code, result.output


def test_a_sound_build_passes_every_check(shared_tiny: Built, tmp_path: Path) -> None:
    code, output = _check(shared_tiny.out, "--json", tmp_path / "check.json")
    assert code == 0, output
    assert output.splitlines()[-1].startswith("check PASSED: 1 of 1 files pass every check in ")
    report = CheckReport.from_dict(json.loads((tmp_path / "check.json").read_text()))
    (found,) = report.files
    assert found.model == "tiny" and found.results == dict.fromkeys(CHECKS)
    assert report.to_dict() == CheckReport.from_dict(report.to_dict()).to_dict()


def _plant_op(op: str, domain: str = "") -> Callable[[onnx.ModelProto], None]:
    def edit(proto: onnx.ModelProto) -> None:
        proto.graph.node.append(helper.make_node(op, ["query"], ["planted_out"], name="planted", domain=domain))
        if domain:
            proto.opset_import.append(helper.make_opsetid(domain, 1))

    return edit


def _rename_batch(proto: onnx.ModelProto) -> None:
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch_size"


def _unknown_op(proto: onnx.ModelProto) -> None:
    proto.graph.node[0].op_type = "NoSuchOp"


@pytest.mark.parametrize(
    ("edit", "check", "problem"),
    [
        (_unknown_op, "checker", "tiny: onnx.checker rejected the graph: "),
        (
            _plant_op("RandomNormalLike"),
            "random-ops",
            "tiny: the graph holds a random op, RandomNormalLike node 'planted'",
        ),
        (
            _plant_op("Custom", "custom.ops"),
            "opset-domain",
            "tiny: Custom node 'planted' is in domain 'custom.ops', which is not allowed "
            "(ai.onnx, ai.onnx.ml, com.microsoft)",
        ),
        (_rename_batch, "axes", "tiny: input 'query' axis 0 is named 'batch_size' in the graph, but the spec names"),
    ],
)
def test_each_planted_graph_fault_fails_its_own_check_only(
    tiny_build: Built, edit: Callable[[onnx.ModelProto], None], check: str, problem: str
) -> None:
    proto = onnx.load(tiny_build.out / "tiny.onnx")
    edit(proto)
    plant(tiny_build.out, "tiny", proto)  # the manifest's hash follows, as a careless rebuild would
    (found,) = check_paths([tiny_build.out / "tiny.onnx"]).files
    assert set(found.problems) == {check}, found.problems
    assert found.problems[check].startswith(problem)
    code, output = _check(tiny_build.out)
    assert code == 1 and output.splitlines()[0].startswith(f"FAIL  {tiny_build.out / 'tiny.onnx'}  (")
    assert output.splitlines()[1] == f"      {check}: {found.problems[check]}"


def test_a_file_changed_after_the_build_fails_the_hashes_only(tiny_build: Built) -> None:
    proto = onnx.load(tiny_build.out / "tiny.onnx")
    proto.producer_name = "an edit"
    onnx.save(proto, tiny_build.out / "tiny.onnx")
    with (tiny_build.out / "tiny.golden.npz").open("ab") as f:
        f.write(b"\0")
    # Named by the golden file: its manifest entry is checked, both hashes with it.
    (found,) = check_paths([tiny_build.out / "tiny.golden.npz"]).files
    assert set(found.problems) == {"hashes"}
    assert found.problems["hashes"].startswith("tiny: tiny.onnx changed after the build: sha256 ")
    assert "; tiny: tiny.golden.npz changed after the build: sha256 " in found.problems["hashes"]


def test_a_golden_file_cut_short_fails_the_golden_check_as_verify_golden_would(tiny_build: Built) -> None:
    """Its hash recorded again, the cut file passed every check, and verify --golden refused it."""
    from attn_export.artifacts.files import sha256_file
    from attn_export.artifacts.golden import read_golden, write_golden

    path = tiny_build.out / "tiny.golden.npz"
    write_golden(path, read_golden(path)[:1])
    doc = json.loads((tiny_build.out / "manifest.json").read_text())
    doc["models"]["tiny"]["golden_sha256"] = sha256_file(path)
    (tiny_build.out / "manifest.json").write_text(json.dumps(doc))
    (found,) = check_paths([tiny_build.out]).files
    assert set(found.problems) == {"golden"}
    assert "tiny.golden.npz: the golden file lacks " in found.problems["golden"]


def test_the_opset_allow_list(tiny_build: Built) -> None:
    code, output = _check(tiny_build.out / "tiny.onnx", "--min-opset", "19")
    assert code == 1 and "      opset-domain: tiny: opset 18 is outside the allowed 19..2" in output
    assert _check(tiny_build.out / "tiny.onnx", "--max-opset", "18")[0] == 0
    code, output = _check(tiny_build.out, "--max-opset", "17")
    assert code == 1 and "tiny: opset 18 is outside the allowed 7..17" in output


def test_a_graph_no_manifest_names_is_held_to_named_dims(shared_tiny: Built, tmp_path: Path) -> None:
    proto = onnx.load(shared_tiny.out / "tiny.onnx")
    onnx.save(proto, tmp_path / "good.onnx")
    proto.graph.input[0].type.tensor_type.shape.dim[1].ClearField("dim_param")
    onnx.save(proto, tmp_path / "unnamed.onnx")
    (good, bad) = check_paths([tmp_path / "good.onnx", tmp_path / "unnamed.onnx"]).files
    assert good.model is None and good.results == dict.fromkeys(["checker", "random-ops", "opset-domain", "axes"])
    assert bad.problems == {"axes": "unnamed.onnx: input 'query' axis 1 has neither a size nor a name in the graph"}


def test_unreadable_files_are_findings(shared_tiny: Built, tmp_path: Path) -> None:
    (tmp_path / "cut.onnx").write_bytes((shared_tiny.out / "tiny.onnx").read_bytes()[:100])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{}")
    (tmp_path / "stray.golden.npz").write_bytes(b"")
    report = check_paths([tmp_path / "cut.onnx", tmp_path / "bad", tmp_path / "stray.golden.npz"])
    assert [(f.path, list(f.problems)) for f in report.files] == [
        (str(tmp_path / "cut.onnx"), ["load"]),
        (str(tmp_path / "bad" / "manifest.json"), ["manifest"]),
        (str(tmp_path / "stray.golden.npz"), ["hashes"]),
    ]
    assert report.exit_code == 1


def test_a_graph_that_is_a_loop_of_symbolic_links_is_a_finding(tiny_build: Built) -> None:
    """It was an internal error (exit 3): Python raises RuntimeError on such a loop."""
    graph = tiny_build.out / "tiny.onnx"
    graph.unlink()
    graph.symlink_to("tiny.onnx")
    code, output = _check(tiny_build.out)
    assert code == 1, output
    assert f"hashes: {graph}: refused: a loop of symbolic links" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nothing.onnx"], "Error: nothing.onnx: no such file\n"),
        (
            ["pyproject.toml"],
            "Error: pyproject.toml: not an .onnx file, a .golden.npz file, a manifest.json or a build folder\n",
        ),
        (["docs"], "Error: docs: a folder without manifest.json; give a build folder, or its files\n"),
        (["x.onnx", "--min-opset", "18", "--max-opset", "17"], "Error: --max-opset 17 is below --min-opset 18\n"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert _check(*args) == (2, message)
