"""localize --golden on a graph no build made: an edited copy of a built graph, given with
--spec, paired with the intermediates the build recorded for its spec's graph (--from), by
the FX nodes its values are named for; no torch, nothing written into the build folder."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from attn_export.artifacts.intermediates import read_intermediates
from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.errors import OptionError
from attn_export.pipelines.localize import LocalizeOptions, LocalizeReport
from tests.conftest import TINY_ZOO, Built, copy_build, plant, scale_initializer, shared_build, unchanged

ZOO_CODE = Path(__file__).resolve().parents[2] / "attn_export" / "zoo"
#: The CLI where torch cannot be imported, as on a deploy box.
NO_TORCH = "import sys; sys.modules['torch'] = None; from attn_export.cli import main; main(sys.argv[1:])"
SPEC = TINY_ZOO / "mha.toml"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo's ``mha`` alone, built with its intermediates recorded (4 s), never changed."""
    built = shared_build(tmp_path_factory, "localize-golden-mha", [SPEC], record_intermediates=True)
    assert built.errors == {"mha": None}, built.errors
    with unchanged(built.out):
        yield built


def test_a_regions_line_on_a_box_without_torch_is_the_one_recorded(recorded: Built, tmp_path: Path) -> None:
    """Read without torch, the graph's own stack trace of a Linear ends in torch's F.linear:
    the line the build recorded, read with torch, is the one that called the layer."""
    built = copy_build(recorded, tmp_path)
    proto = onnx.load(built.out / "mha.onnx")
    scale_initializer(proto, "val_3", 1.25)  # the key projection's weight
    plant(built.out, "mha", proto)
    run = [sys.executable, "-c", NO_TORCH, "localize", str(built.out), "mha", "--golden"]
    found = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)  # no checkout here
    assert found.returncode == 1, found.stderr
    blamed = "DIVERGES first at ONNX node_linear_1 (+1 nodes) [MatMul+Add] from FX node linear_1 (aten.linear.default) "
    assert f"{blamed}in k_linear at {ZOO_CODE / 'seed.py'}:69 `k = self.k_linear(keys)`\n" in found.stdout


def _copy(built: Built, folder: Path, edit: object = None) -> Path:
    """The build's ``mha.onnx`` copied alone into ``folder``, edited by ``edit(proto)``."""
    proto = onnx.load(built.out / "mha.onnx")
    if callable(edit):
        edit(proto)
    folder.mkdir(parents=True)
    onnx.save(proto, folder / "mha.onnx")
    return folder / "mha.onnx"


def _golden(graph: Path, built: Built, *args: str) -> list[str]:
    return ["localize", str(graph), "--spec", str(SPEC), "--golden", "--from", str(built.out), *args]


def test_a_planted_fault_in_an_edited_copy_is_localized_on_the_builds_recording_without_torch(
    recorded: Built, tmp_path: Path
) -> None:
    """The key projection's weight 1.25x in a copy of the built graph: the build folder
    refuses the copy (its sha256 is not the manifest's), and --golden refused --spec. Paired
    with the recording by its values' names, the copy is blamed at k_linear's line, on a box
    without torch or the models' code."""
    graph = _copy(recorded, tmp_path / "edited", lambda p: scale_initializer(p, "val_3", 1.25))
    assert any(n.input == ["keys", "val_3"] for n in onnx.load(graph).graph.node)  # the key projection's MatMul
    run = [sys.executable, "-c", NO_TORCH, *_golden(graph, recorded, "--json", str(tmp_path / "where.json"))]
    found = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)  # no checkout here
    assert found.returncode == 1, found.stderr
    report = LocalizeReport.from_dict(json.loads((tmp_path / "where.json").read_text()))
    first = report.first
    assert first is not None and report.cause == "graph", report.notes
    assert (first.fx_node, first.module_path) == ("linear_1", "k_linear")
    assert first.nodes == ["node_MatMul_4", "node_linear_1"]
    # the recorded line: the graph's own stack trace, read without torch, ends in torch's F.linear
    assert first.source == f"{ZOO_CODE / 'seed.py'}:69" and first.code == "k = self.k_linear(keys)"
    assert [r.fx_node for r in report.regions if r.breaks] == ["linear_1"]
    assert report.golden_case == "distinct" and report.file == str(graph)
    assert report.reproduce == f"attn-export localize {graph} --spec {SPEC} --golden --from {recorded.out}"
    assert sorted(p.name for p in graph.parent.iterdir()) == ["mha.onnx"]


def test_a_right_copy_agrees_with_the_builds_recording(recorded: Built, tmp_path: Path) -> None:
    graph = _copy(recorded, tmp_path / "right")
    result = CliRunner().invoke(cli, _golden(graph, recorded))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("localize mha at the recorded case distinct (batch=2,seq=3)")
    assert "\nAGREES: the graph gives PyTorch's outputs here; 16 regions compared" in result.output


def _renamed(proto: onnx.ModelProto) -> None:
    """Every value between the graph's inputs and outputs renamed, as a tool may leave it."""
    kept = {v.name for v in [*proto.graph.input, *proto.graph.output, *proto.graph.initializer]}
    names: dict[str, str] = {}
    for node in proto.graph.node:
        node.input[:] = [names.get(v, v) for v in node.input]
        node.output[:] = [v if v in kept or not v else names.setdefault(v, f"t{len(names)}") for v in node.output]
    del proto.graph.value_info[:]


@pytest.mark.parametrize(
    ("against", "theirs"),
    [
        ("golden", "the recorded intermediates"),
        pytest.param("torch", "PyTorch's values", marks=pytest.mark.slow),  # an export (5 s)
    ],
)
def test_a_copy_whose_values_cannot_be_paired_is_one_line_and_exit_2(
    recorded: Built, tmp_path: Path, against: str, theirs: str
) -> None:
    """Only the outputs keep their names: comparing them alone would say nothing of where
    (it said AGREES: 1 regions compared, the output's, where a right copy compares 16)."""
    graph = _copy(recorded, tmp_path / "renamed", _renamed)
    args = _golden(graph, recorded) if against == "golden" else ["localize", str(graph), "--spec", str(SPEC)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output == (
        f"Error: mha: mha.onnx cannot be paired with {theirs}: its nodes name 15 FX nodes "
        "besides the outputs', but none of its values is named for one (renamed after the export?)\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--golden"], "Error: --golden localizes a build's recorded intermediates; a graph given with --spec has "
         "none: name the build that recorded its spec's graph with --from\n"),
        (["--from", "{build}"], "Error: --from needs --golden: it names the build whose recorded intermediates it "
         "compares with\n"),
        (["--golden", "--from", "{build}", "--variant", "int8"],
         "Error: {build}: no model 'mha.int8' ({spec} as int8) to pair the graph with; it has: mha\n"),
    ],
)  # fmt: skip
def test_the_pairing_is_asked_for_plainly(recorded: Built, tmp_path: Path, args: list[str], message: str) -> None:
    graph = _copy(recorded, tmp_path / "right")
    named = {"build": str(recorded.out), "spec": str(SPEC)}
    result = CliRunner().invoke(cli, ["localize", str(graph), "--spec", str(SPEC), *[a.format(**named) for a in args]])
    assert (result.exit_code, result.output) == (2, message.format(**named))


def test_a_spec_the_build_did_not_record_is_refused(recorded: Built, tmp_path: Path) -> None:
    """The recording is of the module the build's spec names: another spec's graph is not paired with it."""
    spec = tmp_path / "models" / "mha.toml"
    spec.parent.mkdir()
    spec.write_text(SPEC.read_text().replace("rtol = 1e-4", "rtol = 1e-3"))
    graph = _copy(recorded, tmp_path / "right")
    result = CliRunner().invoke(
        cli, ["localize", str(graph), "--spec", str(spec), "--golden", "--from", str(recorded.out)]
    )
    assert (result.exit_code, result.output) == (
        2,
        f"Error: mha: {recorded.out} recorded it from another spec (spec field tolerance differ): its values are "
        f"not those of {spec}'s module; build it again with --record-intermediates\n",
    )


def test_from_without_a_graph_given_alone_is_refused_in_the_librarys_terms() -> None:
    with pytest.raises(OptionError, match="^golden_from pairs a graph given with spec_file with a build's recording"):
        LocalizeOptions(golden=True, golden_from=Path("build")).check()


def test_an_int4_graphs_recording_is_its_simulation_and_names_a_key_2_percent_off_without_torch(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """For an int4 graph a CPU computes as the simulation rounds, build records the
    simulation's values (its 4 projections rounded, each value's ties), so a deploy box
    localizes its copy as strictly as localize does with torch: the right copy agrees, and the
    key projection's block scales 2 % off are named at k_linear. Recorded as the float module's
    values, no region said where."""
    built = shared_build(
        tmp_path_factory, "localize-golden-mha-int4", [SPEC], variants=("int4",), record_intermediates=True
    )
    assert built.errors == {"mha.int4": None}, built.errors
    spec = load_manifest(built.out).models["mha.int4"].model_spec
    rec = read_intermediates(built.out / "mha.int4.intermediates.npz", spec, 1 << 30)
    assert rec.int4_rounded == 4 and set(rec.ties) <= set(rec.values), rec.int4_rounded
    right = CliRunner().invoke(cli, ["localize", str(built.out), "mha.int4", "--golden", "--strict-regions"])
    assert right.exit_code == 0 and "\nAGREES: " in right.output and "note: regions" not in right.output, right.output

    def key_off(proto: onnx.ModelProto) -> None:
        (key,) = [n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[0] == "keys"]
        scale_initializer(proto, key.input[2], 1.02)

    proto = onnx.load(built.out / "mha.int4.onnx")
    key_off(proto)
    (tmp_path / "edited").mkdir()
    graph = tmp_path / "edited" / "mha.int4.onnx"
    onnx.save(proto, graph)
    args = ["localize", str(graph), "--spec", str(SPEC), "--variant", "int4", "--golden", "--from", str(built.out)]
    found = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=tmp_path)
    assert found.returncode == 1, found.stderr
    blamed = "\nDIVERGES first at ONNX node_linear_1 (+1 nodes) [MatMulNBits+Add] from FX node linear_1 "
    assert blamed in found.stdout, found.stdout
    assert "in k_linear at " in found.stdout, found.stdout
    # at accuracy level 0 a CPU computes in float: the recording, level 4's, is not its simulation
    proto = onnx.load(built.out / "mha.int4.onnx")
    for node in (n for n in proto.graph.node if n.op_type == "MatMulNBits"):
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    onnx.save(proto, graph)
    level0 = CliRunner().invoke(cli, args)
    assert level0.exit_code == 0, level0.output
    assert "this graph computes its MatMulNBits in float (level 0 or 1)" in level0.output, level0.output


def test_a_golden_localize_with_models_holds_the_folders_spec_to_the_checkouts(recorded: Built, tmp_path: Path) -> None:
    """--models was taken and left unread with --golden: a manifest widening its own
    tolerance was localized by it. Named, the checkout's spec is what the recording is held
    to, as verify --golden holds it; unnamed, the folder is trusted as a whole."""
    built = copy_build(recorded, tmp_path)
    doc = json.loads((built.out / "manifest.json").read_text())
    doc["models"]["mha"]["spec"]["tolerance"]["atol"] = 1e6
    (built.out / "manifest.json").write_text(json.dumps(doc))
    trusted = CliRunner().invoke(cli, ["localize", str(built.out), "mha", "--golden"])
    assert trusted.exit_code == 0 and "\nAGREES: " in trusted.output, trusted.output
    held = CliRunner().invoke(cli, ["localize", str(built.out), "mha", "--golden", "--models", str(TINY_ZOO)])
    assert held.exit_code == 2, held.output
    assert held.output.strip().splitlines()[-1] == (
        "Error: mha: stale build: spec field tolerance differ; run attn-export build first"
    ), held.output
    current = CliRunner().invoke(cli, ["localize", str(recorded.out), "mha", "--golden", "--models", str(TINY_ZOO)])
    assert current.exit_code == 0 and f"--golden --models {TINY_ZOO}" in current.output, current.output


def test_a_golden_runs_reproduce_line_keeps_the_default_models_folder_it_was_given(
    recorded: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In golden mode --models is what turns the stale check on, so the reproduce line of a
    run given ``--models models`` (the default's name) must say it: it left it out, and ran
    a different check. Without --models it still says nothing of a folder."""
    from attn_export.pipelines.verify import VerifyOptions, verify_artifacts

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mha.toml").write_text(SPEC.read_text())
    monkeypatch.chdir(tmp_path)
    named = CliRunner().invoke(cli, ["localize", str(recorded.out), "mha", "--golden", "--models", "models"])
    assert named.exit_code == 0 and "--golden --models models\n" in named.output, named.output
    unnamed = CliRunner().invoke(cli, ["localize", str(recorded.out), "mha", "--golden"])
    assert unnamed.exit_code == 0 and "--models" not in unnamed.output, unnamed.output
    for checkout in (True, False):
        options = VerifyOptions(golden=True, golden_checkout=checkout, models_dir=Path("models"), latency=False)
        report = verify_artifacts(recorded.out, load_manifest(recorded.out), ["mha"], options)
        assert report.passed and ("--models models" in report.reproduce(report.cases[0])) == checkout
