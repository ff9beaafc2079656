"""A graph no build made (edited by hand after a build, or exported by a script of the
user's) is verified with ``--spec``, as a built graph is: against the spec's module, over
the sweep, with a reproduce command that reruns a failing case; nothing is written beside
it, and a build folder it sits in is left as it was."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from attn_export.cli import cli
from tests.conftest import Built


def _edited(built: Built, dest: Path, shift: float = 0.0) -> Path:
    """The tiny build's graph, a node renamed (what a careful hand edit leaves: the same
    numbers) and the output bias moved by ``shift`` (a careless one), alone in ``dest``."""
    proto = onnx.load(built.out / "tiny.onnx")
    proto.graph.node[0].name += "_edited"
    for init in proto.graph.initializer:
        if init.name.endswith("out_linear.bias"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.float32(shift), init.name))
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, dest / "tiny.onnx")
    return dest / "tiny.onnx"


def _verify(*args: str) -> object:
    return CliRunner().invoke(cli, ["verify", *args, "--no-latency", "--random", "0"])


def test_a_graph_no_build_made_is_verified_against_the_spec_it_is_given(shared_tiny: Built, tmp_path: Path) -> None:
    graph = _edited(shared_tiny, tmp_path / "edited")
    report = tmp_path / "report.json"
    result = _verify(str(graph), "--spec", str(shared_tiny.models / "tiny.toml"), "--json", str(report))
    assert result.exit_code == 0, result.output
    assert "verify PASSED" in result.output and "tiny " in result.output
    assert sorted(p.name for p in graph.parent.iterdir()) == ["tiny.onnx"]  # nothing written beside it
    doc = json.loads(report.read_text())
    assert doc["settings"]["spec"] == str(shared_tiny.models / "tiny.toml")
    assert doc["cases"] and all(" --spec " in c["reproduce"] for c in doc["cases"])


def test_a_wrong_edit_fails_and_its_reproduce_command_fails_the_same_case(shared_tiny: Built, tmp_path: Path) -> None:
    graph = _edited(shared_tiny, tmp_path / "edited", shift=0.01)
    result = _verify(str(graph), "--spec", str(shared_tiny.models / "tiny.toml"))
    assert result.exit_code == 1, result.output
    assert "outside atol" in result.output and "max abs 0.01" in result.output
    command = next(line.split("reproduce: ", 1)[1] for line in result.output.splitlines() if "reproduce: " in line)
    again = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert again.exit_code == 1, again.output
    assert "0 of 1 cases agree" in again.output
    # judged by the variant's tolerance when the graph is one: int8's holds a shift of 2 % of
    # the output's rms (0.16), not one of 6 % (its error's rms is bounded at 5 %)
    spec = str(shared_tiny.models / "tiny.toml")
    assert _verify(str(graph), "--spec", spec, "--variant", "int8").exit_code == 1
    slight = _edited(shared_tiny, tmp_path / "slight", shift=0.003)
    assert _verify(str(slight), "--spec", spec).exit_code == 1
    loose = _verify(str(slight), "--spec", spec, "--variant", "int8")
    assert loose.exit_code == 0, loose.output
    assert "tiny.int8" in loose.output


def test_a_wrong_edit_is_localized_to_its_node_and_source_line(shared_tiny: Built, tmp_path: Path) -> None:
    """verify --localize and localize --spec name the node the edit changed, from the
    graph's own FX metadata and the spec's module; the reproduce line reruns it."""
    graph = _edited(shared_tiny, tmp_path / "edited", shift=0.01)
    spec = str(shared_tiny.models / "tiny.toml")
    verified = _verify(str(graph), "--spec", spec, "--localize")
    assert verified.exit_code == 1, verified.output
    blame = "DIVERGES first at ONNX node_linear_3 (+1 nodes) [MatMul+Add] from FX node linear_3"
    assert blame in verified.output and "`output = self.out_linear(output)`" in verified.output
    line = next(x for x in verified.output.splitlines() if x.startswith("reproduce: attn-export localize "))
    assert f"{graph} --spec {spec} " in line
    again = CliRunner().invoke(cli, shlex.split(line.removeprefix("reproduce: "))[1:])
    assert again.exit_code == 1 and blame in again.output, again.output
    for args, message in (
        ([str(graph)], "is a file: give its build folder, or --spec"),
        ([str(graph), "other", "--spec", spec], "makes it model 'tiny', not 'other'"),
        ([str(graph), "a{b}", "--spec", spec], "makes it model 'tiny', not 'a{b}'"),  # braces quoted, not fields
        ([str(graph), "--spec", spec, "--golden"], "--golden localizes a build's recorded intermediates"),
        ([str(graph), "--variant", "int8"], "--variant needs --spec"),
    ):
        refused = CliRunner().invoke(cli, ["localize", *args])
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_an_edit_inside_a_build_folder_leaves_the_build_as_it_was(tiny_build: Built) -> None:
    """The build's own check still fails the edited file (it is not the graph built); with
    --spec it is judged by its numbers, and the manifest is not touched."""
    manifest = (tiny_build.out / "manifest.json").read_bytes()
    shutil.move(_edited(tiny_build, tiny_build.out / "edit"), tiny_build.out / "tiny.onnx")
    built = _verify(str(tiny_build.out), "--models", str(tiny_build.models))
    assert built.exit_code == 1 and "tiny.onnx changed after the build" in built.output
    spec = _verify(str(tiny_build.out / "tiny.onnx"), "--spec", str(tiny_build.models / "tiny.toml"))
    assert spec.exit_code == 0, spec.output
    assert (tiny_build.out / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{dir}", "--spec", "{spec}"], "--spec judges one .onnx file, not a folder or another file"),
        (["{dir}/sub.onnx", "--spec", "{spec}"], "sub.onnx: --spec judges one .onnx file, not a folder"),
        (["{graph}", "{graph}", "--spec", "{spec}"], "--spec verifies one .onnx file: give exactly one"),
        (["{graph}", "--spec", "{spec}", "--golden"], "--golden compares with a build's golden file"),
        (["{graph}", "--variant", "int8"], "--variant needs --spec"),
        (["{graph}", "--spec", "{spec}", "--variant", "auto"], "--variant auto chooses among variants"),
        (["{graph}", "--spec", "{dir}/none.toml"], "none.toml: no such spec file"),
        (["{dir}/none.onnx", "--spec", "{spec}"], "none.onnx: no such file"),
        (
            ["{graph}", "--spec", "{renamed}"],
            "tiny.onnx: graph inputs ['query', 'keys', 'values'] != spec inputs ['q', 'keys', 'values']: "
            "--spec {renamed} does not describe this graph",
        ),
        (
            ["{graph}", "--spec", "{float64}"],
            "tiny.onnx: input 'query' is float32 in the graph, spec says float64: --spec {float64} does not",
        ),
        (
            ["{graph}", "--spec", "{wider}"],
            "tiny.onnx: input 'query' axis 2 is 16 in the graph, spec says 24: --spec {wider} does not",
        ),
    ],
    ids=[
        "folder",
        "folder.onnx",
        "two-files",
        "golden",
        "variant-alone",
        "chooser",
        "no-spec",
        "no-graph",
        "renamed",
        "float64",
        "wider",
    ],
)
def test_bad_usage_is_one_line_and_exit_2(shared_tiny: Built, tmp_path: Path, args: list[str], message: str) -> None:
    graph = _edited(shared_tiny, tmp_path / "edited")
    (graph.parent / "sub.onnx").mkdir()
    spec = str(shared_tiny.models / "tiny.toml")
    where = {"{graph}": str(graph), "{dir}": str(graph.parent), "{spec}": spec}
    edits = {  # specs of other graphs: no feed made from them fits this one
        "{renamed}": ('name = "query"', 'name = "q"'),
        "{float64}": ('name = "query"', 'name = "query"\ndtype = "float64"'),
        "{wider}": ('shape = ["batch", "seq", 16]\n[[inputs]]', 'shape = ["batch", "seq", 24]\n[[inputs]]'),
    }
    for key, (old, new) in edits.items():
        other = tmp_path / key.strip("{}") / "tiny.toml"
        other.parent.mkdir()
        other.write_text((shared_tiny.models / "tiny.toml").read_text().replace(old, new, 1))
        where[key] = str(other)
    for key, value in where.items():
        args = [a.replace(key, value) for a in args]
        message = message.replace(key, value)
    result = _verify(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert "FAIL " not in result.output  # refused before any case ran
    assert sorted(p.name for p in graph.parent.iterdir()) == ["sub.onnx", "tiny.onnx"]


def test_the_python_api_takes_the_spec_too(shared_tiny: Built, tmp_path: Path) -> None:
    import attn_export

    graph = _edited(shared_tiny, tmp_path / "edited", shift=0.003)
    report = attn_export.verify(graph, spec=shared_tiny.models / "tiny.toml", n_random=0)
    assert not report.passed and report.models() == ["tiny"]
    assert report.settings["spec"] == str(shared_tiny.models / "tiny.toml")
    loose = attn_export.verify(graph, spec=shared_tiny.models / "tiny.toml", variant="int8", n_random=0)
    assert loose.passed and loose.models() == ["tiny.int8"]


def test_a_spec_in_a_build_folder_is_refused(tiny_build: Built, tmp_path: Path) -> None:
    """A build folder is data: a spec in it, at any depth, names a module verify would
    import, so it is refused, as --models inside a build folder is; a project's own file
    named manifest.json does not make its folder a build folder."""
    graph = _edited(tiny_build, tmp_path / "edited")
    for where in (tiny_build.out, tiny_build.out / "models" / "deeper"):
        where.mkdir(parents=True, exist_ok=True)
        spec = shutil.copy(tiny_build.models / "tiny.toml", where / "tiny.toml")
        for target in (tiny_build.out / "tiny.onnx", graph):
            result = _verify(str(target), "--spec", str(spec))
            assert result.exit_code == 2 and "lies in the build folder" in result.output, result.output
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "manifest.json").write_text('{"name": "a web app", "schema": "other"}')
    spec = shutil.copy(tiny_build.models / "tiny.toml", project / "models" / "tiny.toml")
    assert _verify(str(graph), "--spec", str(spec)).exit_code == 0
    (project / "models" / "loop.toml").symlink_to(project / "models" / "loop.toml")
    looped = _verify(str(graph), "--spec", str(project / "models" / "loop.toml"))
    assert looped.exit_code == 2 and "Traceback" not in looped.output, looped.output


def test_the_spec_file_named_is_the_one_read(shared_tiny: Built, tmp_path: Path) -> None:
    """Not a spec of the same name beside it: the file given, whatever its name."""
    graph = _edited(shared_tiny, tmp_path / "edited")
    specs = tmp_path / "specs"
    specs.mkdir()
    named = shutil.copy(shared_tiny.models / "tiny.toml", specs / "tiny.txt")
    text = (shared_tiny.models / "tiny.toml").read_text().replace("hidden_dim = 16", "hidden_dim = 32")
    (specs / "tiny.toml").write_text(text)  # another module by the same name
    result = _verify(str(graph), "--spec", str(named))
    assert result.exit_code == 0, result.output


def test_a_graph_that_changes_while_it_is_verified_fails(
    shared_tiny: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run reads the file again: one changed after it was hashed was not the graph
    judged, and the verdict says so."""
    import attn_export.pipelines.verify.run as run

    graph = _edited(shared_tiny, tmp_path / "edited")
    wrong = _edited(shared_tiny, tmp_path / "wrong", shift=0.01).read_bytes()
    collect = run._collect

    def swapped(*args: object) -> None:  # once the runs' records are in, before the rows are shown
        collect(*args)  # type: ignore[arg-type]
        graph.write_bytes(wrong)

    monkeypatch.setattr(run, "_collect", swapped)
    result = _verify(str(graph), "--spec", str(shared_tiny.models / "tiny.toml"))
    assert result.exit_code == 1, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("tiny ") and "checks" in line)
    assert "FAIL" in row and "tiny.onnx changed while it was verified" in row


def test_a_spec_reading_the_mask_the_wrong_way_round_is_refused_as_build_refuses_it(
    zoo_dir: Path, tmp_path: Path
) -> None:
    """nn.MultiheadAttention's key_padding_mask declared True = attend: build refuses it, and
    verify --spec passed the graph, its named mask cases testing other rows."""
    from tests.conftest import TINY_ZOO

    wrong = tmp_path / "torch_mha.toml"
    wrong.write_text(
        (TINY_ZOO / "torch_mha.toml").read_text().replace('convention = "ignore"', 'convention = "attend"')
    )
    result = _verify(str(zoo_dir / "torch_mha.onnx"), "--spec", str(wrong))
    assert result.exit_code == 2, result.output
    assert "mask 'key_padding_mask' read as 'attend'" in result.output
    assert "the module reads the mask another way" in result.output
