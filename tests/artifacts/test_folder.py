"""The build folder's commit protocol: a rebuild interrupted at any file operation leaves a
folder that verifies (each graph's previous or new build), and the next build or verify
says so in one line and cleans up.

By default a sample of the interruption points runs (before the first operation, at each
swap of the manifest and after the last); the slow tests run every other one."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.artifacts.files import LOCK_NAME, sha256_file
from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.pipelines.building import BuildOptions, build_models
from tests.conftest import tiny_spec

VARIANTS = ("fp32", "int8")
Snapshot = dict[str, bytes]


def _snapshot(folder: Path) -> Snapshot:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != LOCK_NAME}


def _restore(snapshot: Snapshot, folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in snapshot.items():
        (folder / name).write_bytes(data)
    return folder


class _FileOps:
    """Every file operation a build makes in one folder (create a temporary file, write it,
    rename, remove): fails the ``fail_at``-th, or photographs the folder after each."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.folder, self.fail_at = folder, fail_at
        self.count = 0
        self.snapshots: list[Snapshot] = [_snapshot(folder)]
        self.photograph = fail_at is None
        real = {"mkstemp": tempfile.mkstemp, "fsync": os.fsync, "replace": os.replace, "unlink": os.unlink}

        def mkstemp(*args, **kwargs):
            return self._op(Path(kwargs.get("dir", ".")), lambda: real["mkstemp"](*args, **kwargs))

        def fsync(fd):
            return self._op(Path(os.readlink(f"/proc/self/fd/{fd}")).parent, lambda: real["fsync"](fd))

        def replace(src, dst, *args, **kwargs):
            return self._op(Path(dst).parent, lambda: real["replace"](src, dst, *args, **kwargs))

        def unlink(path, *args, **kwargs):
            return self._op(Path(path).parent, lambda: real["unlink"](path, *args, **kwargs))

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        for name, fake in (("fsync", fsync), ("replace", replace), ("unlink", unlink)):
            monkeypatch.setattr(os, name, fake)

    def _op(self, where: Path, run: Callable[[], object]) -> object:
        if where.resolve() != self.folder.resolve():
            return run()
        self.count += 1
        if self.count == self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        out = run()
        if self.photograph:
            self.snapshots.append(_snapshot(self.folder))
        return out


@pytest.fixture(scope="module")
def rebuild(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Snapshot, Snapshot]:
    """A built folder (the old build), a changed spec, and the folder a clean rebuild gives."""
    root = tmp_path_factory.mktemp("rebuild")
    spec = tiny_spec(root / "models", exporter="torchscript")  # the fastest exporter: many builds follow
    # int8's error on outlier and x100 values is not this test's subject: a tolerance that accepts it
    spec.write_text(spec.read_text() + "\n[variants.int8]\natol = 1000.0\nrtol = 1.0\n")
    old = root / "old"
    assert all(r.ok for r in build_models([spec], BuildOptions(old, variants=VARIANTS)).results)
    spec.write_text(spec.read_text() + "\n[weights]\nseed = 7\n")  # new weights: every graph and golden changes
    new = _restore(_snapshot(old), root / "new")
    assert all(r.status == "built" for r in build_models([spec], BuildOptions(new, variants=VARIANTS)).results)
    return spec, root, _snapshot(old), _snapshot(new)


def _entries(folder: Path) -> dict[str, tuple[str, str]]:
    """Each graph's (sha256, golden_sha256), after checking the files hold them."""
    manifest = load_manifest(folder)
    for e in manifest.models.values():
        assert sha256_file(folder / e.file) == e.sha256, e.file
        assert sha256_file(folder / e.golden) == e.golden_sha256, e.golden
    return {name: (e.sha256, e.golden_sha256) for name, e in manifest.models.items()}


def _is_whole(folder: Path, old: Snapshot, new: Snapshot, where: Path) -> None:
    """Every graph is its whole previous build or its whole new one."""
    before, after = _entries(_restore(old, where / "old")), _entries(_restore(new, where / "new"))
    got = _entries(folder)
    assert set(got) == set(before)
    for name, hashes in got.items():
        assert hashes in (before[name], after[name]), name


def _rebuild(spec: Path, folder: Path) -> list[str]:
    notes: list[str] = []
    summary = build_models([spec], BuildOptions(folder, variants=VARIANTS), on_notice=notes.append)
    assert all(r.ok for r in summary.results), [r.error for r in summary.results]
    return notes


def _sample(snapshots: list[Snapshot]) -> set[int]:
    """The photographs taken before the first operation, after each that swapped in a new
    manifest (the commit points) and after the last: the same every run."""
    swaps = {
        i
        for i in range(1, len(snapshots))
        if snapshots[i].get("manifest.json") != snapshots[i - 1].get("manifest.json")
    }
    return {0, len(snapshots) - 1} | swaps


#: The sample of interruption points by default, every other point in the slow run.
POINTS = [pytest.param(False, id="sample"), pytest.param(True, id="rest", marks=pytest.mark.slow)]


def _leftovers(folder: Path) -> bool:
    """Whether the folder holds a hidden file its manifest does not name (what a killed build leaves)."""
    named = {n for e in load_manifest(folder).models.values() for n in (e.file, e.golden)}
    return any(p.name.startswith(".") and p.name not in named | {LOCK_NAME} for p in folder.iterdir())


@pytest.mark.parametrize("rest", POINTS)
def test_a_build_killed_after_any_file_operation_leaves_a_folder_that_verifies(
    rebuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rest: bool
) -> None:
    spec, _, old, new = rebuild
    folder = _restore(old, tmp_path / "out")
    with monkeypatch.context() as m:
        ops = _FileOps(folder, m)
        _rebuild(spec, folder)
    assert ops.count >= 30 and len(ops.snapshots) == ops.count + 1
    assert _snapshot(folder) == new
    sample = _sample(ops.snapshots)
    assert len(sample) >= 4  # before, two commits per graph at least, after
    for i, snapshot in enumerate(ops.snapshots):  # the folder as a kill -9 after operation i leaves it
        if (i in sample) == rest:
            continue
        image = _restore(snapshot, tmp_path / f"verify{i}")
        _is_whole(image, old, new, tmp_path / "ref")
        left = _leftovers(image)
        result = CliRunner().invoke(cli, ["verify", str(image), "--golden", "--no-latency"])
        assert result.exit_code == 0, (i, result.output)
        note = f"note: an earlier build of {image} was interrupted; removed "
        assert (note in result.output) == left, (i, result.output)
        assert not _leftovers(image)
        assert (image / LOCK_NAME).exists() == left  # verify writes nothing unless it has something to clean

        image = _restore(snapshot, tmp_path / f"build{i}")
        notes = _rebuild(spec, image)
        assert len(notes) <= 1 and (bool(notes) or not left), (i, notes)
        assert all(n.startswith(f"an earlier build of {image} was interrupted; ") for n in notes), notes
        assert _snapshot(image) == new, i  # the next build finishes the job: the same bytes as a clean one


@pytest.mark.parametrize("rest", POINTS)
def test_a_build_failing_at_any_file_operation_keeps_a_folder_that_verifies(
    rebuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rest: bool
) -> None:
    spec, _, old, new = rebuild
    with monkeypatch.context() as m:
        total = _FileOps(_restore(old, tmp_path / "count"), m)
        _rebuild(spec, tmp_path / "count")
    sample = _sample(total.snapshots) - {0} | {1}  # failing the first operation, each commit and the last
    for k in range(1, total.count + 1):
        if (k in sample) == rest:
            continue
        folder = _restore(old, tmp_path / f"fail{k}")
        with monkeypatch.context() as m:
            _FileOps(folder, m, fail_at=k)
            summary = build_models([spec], BuildOptions(folder, variants=VARIANTS))
        failed = [r.error for r in summary.results if not r.ok]
        assert all("disk full" in e for e in failed), failed
        _is_whole(folder, old, new, tmp_path / "ref")
        notes = _rebuild(spec, folder)
        assert all(n.startswith(f"an earlier build of {folder} was interrupted; ") for n in notes), notes
        assert _snapshot(folder) == new, k


def test_a_variant_of_an_older_build_keeps_its_golden_file(rebuild, tmp_path: Path) -> None:
    spec, _, old, new = rebuild
    folder = _restore(old, tmp_path / "out")
    assert [r.status for r in build_models([spec], BuildOptions(folder)).results] == ["built"]
    manifest = load_manifest(folder)
    fp32, int8 = manifest.models["tiny"], manifest.models["tiny.int8"]
    assert fp32.golden.startswith(".tiny.golden.npz.") and int8.golden == "tiny.golden.npz"
    result = CliRunner().invoke(cli, ["verify", str(folder), "--golden", "--no-latency"])
    assert result.exit_code == 0, result.output
    assert [r.status for r in build_models([spec], BuildOptions(folder, variants=("int8",))).results] == ["built"]
    assert _snapshot(folder) == new
