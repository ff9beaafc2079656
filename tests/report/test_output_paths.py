"""Report paths cannot clobber: a report, a plot or the step summary is written only to a
regular file or a new path. A FIFO, a device, a socket, a directory or a symlink to one of
them (or to nothing) is a one-line error (exit 2) before any work, and is left as it was;
a symlink to a regular file is written through. Inside a build folder, the lock file is
never followed through a symlink."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from attn_export.artifacts.files import LOCK_NAME
from attn_export.cli import cli
from tests.conftest import TINY_ZOO, Built


def _verify(built: Built, *args: str) -> Result:
    return CliRunner().invoke(cli, ["verify", str(built.out), "--golden", "--no-latency", *args])


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


def _socket(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    return path


def _device(path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a null device
    return path


MAKERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (_fifo, "a FIFO"),
    "directory": (_directory, "a directory"),
    "socket": (_socket, "a socket"),
    "device": (_device, "a character device"),
}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("option", ["--json", "--junit", "--markdown"])
def test_a_report_path_that_is_not_a_file_is_refused_and_left_alone(
    shared_tiny: Built, tmp_path: Path, kind: str, option: str
) -> None:
    make, what = MAKERS[kind]
    target = make(tmp_path / "target")
    before = os.lstat(target)
    result = _verify(shared_tiny, option, str(target))
    assert result.exit_code == 2, result.output
    if kind == "directory":  # click's own check on the option says so first
        assert f"'{target}' is a directory" in result.output
    else:
        assert result.output == f"Error: {target} is {what}; reports are written only to a regular file or a new path\n"
    after = os.lstat(target)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino)


def test_a_symlink_is_written_through_to_a_regular_file_only(shared_tiny: Built, tmp_path: Path) -> None:
    regular = tmp_path / "report.json"
    regular.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(regular)
    assert _verify(shared_tiny, "--json", str(link)).exit_code == 0
    assert link.is_symlink() and regular.read_text().startswith("{")
    fifo_link = tmp_path / "fifo.json"
    fifo_link.symlink_to(_fifo(tmp_path / "fifo"))
    result = _verify(shared_tiny, "--json", str(fifo_link))
    assert result.exit_code == 2 and f"(the symlink's target {tmp_path / 'fifo'})" in result.output
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    result = _verify(shared_tiny, "--json", str(dangling))
    assert result.exit_code == 2 and "is a symlink to nothing" in result.output
    assert not (tmp_path / "nowhere").exists()


def test_a_step_summary_that_is_a_fifo_is_refused_without_blocking(
    shared_tiny: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(_fifo(tmp_path / "summary")))
    result = _verify(shared_tiny)
    assert result.exit_code == 2 and "is a FIFO" in result.output


def test_bench_refuses_a_plot_path_before_timing_anything(shared_tiny: Built, tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "plot.png")
    args = ["bench", str(shared_tiny.models / "tiny.toml"), "--out", str(tmp_path / "out"), "--plot", str(fifo)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and result.output.startswith(f"Error: {fifo} is a FIFO")
    assert not (tmp_path / "out").exists()  # refused before building or timing


def test_a_lock_file_planted_as_a_symlink_creates_nothing(tiny_torchscript_build: Built, tmp_path: Path) -> None:
    tiny_build = tiny_torchscript_build  # torchscript, the fastest exporter: --force rebuilds it
    victim = tmp_path / "victim"
    lock = tiny_build.out / LOCK_NAME
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    args = ["build", "--models", str(tiny_build.models), "--out", str(tiny_build.out), "--force"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "is a symlink; remove it" in result.output
    assert not victim.exists()


def test_a_lock_file_planted_as_a_fifo_is_refused_not_waited_on(zoo_copy: Path) -> None:
    lock = zoo_copy / LOCK_NAME
    lock.unlink(missing_ok=True)
    os.mkfifo(lock)
    for args in (
        ["verify", str(zoo_copy), "--golden", "--no-latency"],
        ["build", "--models", str(TINY_ZOO), "--out", str(zoo_copy)],
    ):
        result = CliRunner().invoke(cli, args)  # opening it blocked for good
        assert result.exit_code == 2, result.output
        assert result.output == f"Error: {lock} is not a regular file; remove it\n"


def test_a_report_never_replaces_a_file_of_the_folder_it_verifies(zoo_copy: Path, tmp_path: Path) -> None:
    """Written over the manifest, a passing run left the folder unreadable for the next; a
    report into a folder that does not exist is refused before the run, not after it."""
    graph = str(zoo_copy / "sdpa.onnx")
    for flag, name, why in (
        ("--json", "manifest.json", f"is manifest.json of the build folder {zoo_copy}"),
        ("--junit", "mha.onnx", ": .onnx is an ONNX graph's suffix, not a report's"),
        ("--markdown", "sdpa.golden.npz", ": .npz is a golden file's suffix, not a report's"),
    ):
        before = (zoo_copy / name).read_bytes()
        result = CliRunner().invoke(cli, ["verify", graph, "--golden", "--no-latency", flag, str(zoo_copy / name)])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"Error: {flag} {zoo_copy / name}{'' if why[0] == ':' else ' '}{why}")
        assert (zoo_copy / name).read_bytes() == before
    missing = tmp_path / "nowhere" / "r.json"
    result = CliRunner().invoke(cli, ["verify", graph, "--golden", "--no-latency", "--json", str(missing)])
    assert (result.exit_code, result.output) == (2, f"Error: cannot write {missing}: no folder {missing.parent}\n")
    # a folder that takes no file (it failed after the whole run, the report lost)
    result = CliRunner().invoke(cli, ["verify", graph, "--golden", "--no-latency", "--json", "/proc/r.json"])
    assert (result.exit_code, result.output) == (2, "Error: cannot write /proc/r.json: No such file or directory\n")


def test_no_command_writes_a_report_over_what_it_reads_or_over_a_spec(zoo_copy: Path, tmp_path: Path) -> None:
    """localize, check, report merge and bench wrote their reports over a build folder's
    manifest or graph, and verify over the checkout's spec: each run passed, and the next
    found the folder or the spec gone."""
    (tmp_path / "spec.toml").write_text("name = 'x'\n")
    shards = [tmp_path / "a.json", tmp_path / "b.json"]
    for shard in shards:
        shard.write_text("{}")
    manifest, out = zoo_copy / "manifest.json", tmp_path / "o"
    (zoo_copy / "genai").mkdir()
    cases = [
        (["localize", str(zoo_copy), "mha", "--json", str(manifest)], f"--json {manifest} is a file this command"),
        (["localize", str(zoo_copy), "mha", "--overlay", str(zoo_copy / "mha.onnx")], ".onnx is an ONNX graph's"),
        (["check", str(zoo_copy), "--json", str(manifest)], f"--json {manifest} is a file this command reads"),
        (["check", str(zoo_copy / "mha.onnx"), "--json", str(manifest)], "is a file this command reads"),
        (["report", "merge", *map(str, shards), "--json", str(shards[0])], "is a file this command reads"),
        # merge reads no build folder: the manifest was replaced by the merged report
        (["report", "merge", *map(str, shards), "--json", str(manifest)],
         f"is manifest.json of the build folder {zoo_copy}"),
        # nor any other path in a build folder: merge reads none, so it writes into none
        (["report", "merge", *map(str, shards), "--json", str(zoo_copy / "merged.json")],
         f"--json {zoo_copy / 'merged.json'} is inside the build folder {zoo_copy}; write the report elsewhere"),
        (["report", "merge", *map(str, shards), "--junit", str(zoo_copy / "genai" / "m.xml")],
         f"--junit {zoo_copy / 'genai' / 'm.xml'} is inside the build folder {zoo_copy}; write the report elsewhere"),
        (["verify", str(zoo_copy), "--golden", "--json", str(tmp_path / "spec.toml")], ".toml is a spec's suffix"),
        (["bench", str(TINY_ZOO / "mha.toml"), "--out", str(out), "--json", str(out / "manifest.json")],
         "is a file this command reads"),
        (["verify", str(zoo_copy), "--golden", "--json", str(tmp_path / "r"), "--junit", str(tmp_path / "r")],
         f"--json and --junit both name {tmp_path / 'r'}: give each report a file of its own"),
    ]  # fmt: skip
    before = {p: p.read_bytes() for p in [*zoo_copy.iterdir(), *tmp_path.glob("*.*")] if p.is_file()}
    for args, said in cases:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and said in result.output, (args, result.output)
        assert len(result.output.splitlines()) == 1
    assert {p: p.read_bytes() for p in before} == before
    assert not out.exists() and not (tmp_path / "r").exists()


def test_no_report_is_written_over_a_bundle_external_data_or_through_the_step_summary(
    zoo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each passed and left what it read unreadable: localize's --json inside its own --bundle,
    a report over a graph's external data, $GITHUB_STEP_SUMMARY naming the manifest."""
    import onnx

    ext = tmp_path / "ext"
    ext.mkdir()
    onnx.save(onnx.load(zoo_copy / "mha.onnx"), ext / "m.onnx", save_as_external_data=True, location="m.data",
              size_threshold=0)  # fmt: skip
    data = (ext / "m.data").read_bytes()
    spec = str(TINY_ZOO / "mha.toml")
    bundle = tmp_path / "b"
    cases = [
        (["localize", str(zoo_copy), "mha", "--bundle", str(bundle), "--json", str(bundle / "bundle.json")],
         "is a file this command reads"),
        (["check", str(ext / "m.onnx"), "--json", str(ext / "m.data")], "is a file this command reads"),
        (["verify", str(ext / "m.onnx"), "--spec", spec, "--json", str(ext / "m.data")], "is a file this command"),
        (["localize", str(ext / "m.onnx"), "--spec", spec, "--json", str(ext / "m.data")], "is a file this command"),
    ]  # fmt: skip
    for args, said in cases:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and said in result.output, (args, result.output)
    assert (ext / "m.data").read_bytes() == data and not bundle.exists()
    manifest = zoo_copy / "manifest.json"
    before = manifest.read_bytes()
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(manifest))
    result = _verify(Built(zoo_copy, TINY_ZOO, {}))
    assert (
        result.exit_code == 2
        and f"$GITHUB_STEP_SUMMARY {manifest} is manifest.json of the build folder {zoo_copy}" in result.output
    )
    assert manifest.read_bytes() == before
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))
    result = _verify(Built(zoo_copy, TINY_ZOO, {}))
    assert result.output.startswith(f"Error: $GITHUB_STEP_SUMMARY: {tmp_path} is a directory")
