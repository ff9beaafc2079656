"""build at scale: each spec file is a cell; with --jobs or on Ray the folder ends byte for
byte as a serial build leaves it, whatever order the cells finish in; a chooser that times
graphs is refused beside other cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from tests.conftest import TINY_ZOO

#: Two small specs and two variants each: cells that stage four graphs and share golden files.
SAMPLE = ("mha", "sdpa")
VARIANTS = ("--variant", "fp32", "--variant", "int8")


def _build(out: Path, *args: str, names: tuple[str, ...] = SAMPLE) -> Result:
    return CliRunner().invoke(cli, ["build", *names, "--models", str(TINY_ZOO), "--out", str(out), *VARIANTS, *args])


def _folder(out: Path) -> dict[str, str]:
    """Every file a build left, by name, with its hash (the lock file aside)."""
    return {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.name != ".attn-export.lock"}


@pytest.mark.slow
def test_jobs_leave_the_folder_a_serial_build_leaves(zoo_dir: Path, tmp_path: Path) -> None:
    result = _build(tmp_path / "jobs", "--jobs", "2")
    assert result.exit_code == 0, result.output
    files = _folder(tmp_path / "jobs")
    manifest = load_manifest(tmp_path / "jobs")
    assert sorted(manifest.models) == ["mha", "mha.int8", "sdpa", "sdpa.int8"]
    # every entry names a stable file that is there, with its hash: no staged name survives
    named = {name: sha for e in manifest.models.values() for name, sha in e.files()}
    assert named == {k: v for k, v in files.items() if k != "manifest.json"}
    # the plain graphs and golden files are the serial shared build's, byte for byte
    serial = load_manifest(zoo_dir)
    for name in SAMPLE:
        assert (manifest.models[name].sha256, manifest.models[name].golden_sha256) == (
            serial.models[name].sha256,
            serial.models[name].golden_sha256,
        )
    again = _build(tmp_path / "jobs", "--jobs", "2")
    skipped = [line.split()[1] for line in again.output.splitlines() if line.startswith("skipped")]
    assert again.exit_code == 0 and skipped == ["mha", "mha.int8", "sdpa", "sdpa.int8"], again.output


def test_a_chooser_that_times_graphs_is_refused_beside_other_cells(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["build", "mha", "--models", str(TINY_ZOO), "--out", str(tmp_path), "--variant", "auto", "--jobs", "2"]
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "Error: --variant auto times its candidates, and timing never runs beside another cell: "
        "build it with one job on the local executor"
    )
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("--jobs", "2"), ("--executor", "ray")], ids=["jobs", "ray"])
def test_the_tiny_zoo_builds_byte_for_byte_the_same_on_any_executor(tmp_path: Path, mode: tuple[str, ...]) -> None:
    if "ray" in mode:
        pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    names = tuple(p.stem for p in sorted(TINY_ZOO.glob("*.toml")))
    serial = _build(tmp_path / "serial", names=names)
    parallel = _build(tmp_path / "parallel", *mode, names=names)
    assert serial.exit_code == 0 and parallel.exit_code == 0, serial.output + parallel.output
    assert _folder(tmp_path / "serial") == _folder(tmp_path / "parallel")
    lines = [line.split()[:2] for line in parallel.output.splitlines() if line.startswith("built")]
    assert lines == [line.split()[:2] for line in serial.output.splitlines() if line.startswith("built")]
    assert json.loads((tmp_path / "parallel" / "manifest.json").read_text())["models"]
