"""Executors: one job runs cells here, --jobs N in other processes, ray names its extra when
missing; a cell's key is the hash of its content."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import OptionError, UsageError
from attn_export.executors import InlineExecutor, Parallelism, cell_key, open_executor
from attn_export.runtimes.timing import THREADS_PER_CPU, usable_cpus
from tests.conftest import Built, tiny_spec


def test_one_job_runs_cells_in_this_process() -> None:
    with open_executor(Parallelism()) as executor:
        assert isinstance(executor, InlineExecutor)
        assert executor.submit(os.getpid).result() == os.getpid()
        failed = executor.submit(int, "x")
        assert isinstance(failed.exception(), ValueError)
    assert not Parallelism().parallel and not Parallelism(jobs=1).parallel and Parallelism(jobs=2).parallel


def test_jobs_run_cells_in_other_processes() -> None:
    with open_executor(Parallelism("local", 2)) as executor:
        pids = {executor.submit(os.getpid).result() for _ in range(2)}
    assert os.getpid() not in pids


def test_a_cell_key_is_the_hash_of_its_content() -> None:
    key = cell_key("verify-case", ["a" * 64, {"seed": 0}, 3])
    assert key == cell_key("verify-case", ["a" * 64, {"seed": 0}, 3]) and len(key) == 64
    assert key != cell_key("verify-case", ["a" * 64, {"seed": 1}, 3])
    assert key != cell_key("verify-timing", ["a" * 64, {"seed": 0}, 3])


def test_bad_executor_choices_are_refused_in_one_line(zoo_dir: Path) -> None:
    with pytest.raises(OptionError, match="^jobs 0: give 1 to 4096, or auto"):  # the library's name
        Parallelism(jobs=0)
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir), "--jobs", "two"])
    assert result.exit_code == 2 and "Invalid value for '--jobs': 'two' is not a number of jobs" in result.output
    # past a C int the process pool stopped with an internal error (exit 3)
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir), "--jobs", "99999999999"])
    assert (result.exit_code, result.output) == (2, "Error: --jobs 99999999999: give 1 to 4096, or auto\n")
    # a process per cell, each holding PyTorch: --jobs 4096 started 50 of them on a 2-CPU machine
    many = THREADS_PER_CPU * usable_cpus() + 1
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir), "--jobs", str(many), "--no-latency"])
    assert result.exit_code == 2 and f"Error: --jobs {many}: more processes than this machine's" in result.output
    assert f"give at most {many - 1}, or run on a Ray cluster (--executor)" in result.output, result.output
    import attn_export

    api = rf"^jobs {many}: .* give at most {many - 1}, or run on a Ray cluster \(executor\)$"
    with pytest.raises(OptionError, match=api):
        attn_export.verify(zoo_dir, jobs=many)  # the API's names
    assert Parallelism("ray", jobs=many).jobs == many  # a cluster's CPUs are not this machine's


def test_ray_missing_names_the_extra(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as where ray is not installed
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir), "--executor", "ray", "--no-latency"])
    assert result.exit_code == 2
    assert result.output == "Error: --executor ray needs ray, which is not installed (pip install 'attn-export[ray]')\n"


def test_a_ray_address_where_no_cluster_runs_is_one_line(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init waited minutes on it, printing its own retries; a Ray Client address without
    the client installed was a traceback."""
    pytest.importorskip("ray")
    args = ["verify", str(zoo_dir), "--golden", "--executor", "ray", "--no-latency"]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # nothing listens there
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(f"Error: --executor ray: no Ray cluster answers at $RAY_ADDRESS=127.0.0.1:{port} (")
    with _listener(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:  # a web server on the port: ray.init hung
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(
        f"Error: --executor ray: something listens at $RAY_ADDRESS=127.0.0.1:{port}, but not a Ray cluster "
        "(it answered b'HTTP/1.1 ', where a cluster's gRPC server answers HTTP/2); start one with `ray start --head`"
    )
    if importlib.util.find_spec("grpc") is not None:
        return  # Ray Client is installed: it would try to speak to the server below
    with _listener(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])) as port:  # answers as a gRPC server does
        monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "cannot join the Ray cluster at $RAY_ADDRESS=ray://" in result.output and "ray[client]" in result.output


@contextlib.contextmanager
def _listener(answer: bytes) -> Iterator[int]:
    """A port whose server sends ``answer`` to each connection, then waits for it to close."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = server.accept()
                peer.sendall(answer)
                threading.Thread(target=lambda p=peer: (p.recv(1 << 16), p.close()), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_the_python_api_takes_the_executor(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import attn_export
    from attn_export.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"--executor ray needs ray"):
        attn_export.verify(zoo_dir, models=zoo_dir.parent, executor="ray")
    with pytest.raises(OptionError, match="^jobs 0"):  # the API's parameter
        attn_export.verify(zoo_dir, jobs=0)


def test_a_ray_task_runs_from_the_drivers_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker starts in Ray's session folder: on a cluster, `verify build` said
    "build/x.onnx: no such file". The task runs from the driver's folder, or says which it lacks."""
    from attn_export.executors.ray import _in_driver_folder

    monkeypatch.chdir(tmp_path.parent)  # restored after the test, as the task moves this process
    (tmp_path / "build").mkdir()
    assert _in_driver_folder(str(tmp_path), os.path.isdir, "build") is True
    with pytest.raises(UsageError, match=r"has no folder /no/such/folder \(the working directory the run started in"):
        _in_driver_folder("/no/such/folder", os.path.isdir, "build")


def test_a_ray_task_is_sent_with_the_drivers_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local cluster's workers start where the driver did, so only the wiring shows it."""
    from concurrent.futures import Future

    from attn_export.executors.ray import RayExecutor, _in_driver_folder

    sent: list[tuple] = []

    class _Ref:
        def future(self) -> Future:
            return Future()

    class _Remote:
        def remote(self, *args: object) -> _Ref:
            sent.append(args)
            return _Ref()

    class _Ray:
        def remote(self, **options: object):
            return lambda fn: _Remote() if fn is _in_driver_folder else None

    executor = object.__new__(RayExecutor)
    executor.__dict__.update(_ray=_Ray(), _jobs=None, _remote=None, _in_flight=[], _refs=[], _nodes=[], _submitted=0)
    monkeypatch.chdir(tmp_path)
    executor.submit(os.path.isdir, "build")
    assert sent == [(str(tmp_path), os.path.isdir, "build")]


def _running(pid: int) -> bool:
    """Whether a process runs (a zombie has ended: only its parent has yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _workers(parent: int) -> list[int]:
    """The process pool's workers that ``parent`` spawned."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid == parent and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def _stopped(args: Sequence[str], sig: signal.Signals, workers: int) -> tuple[int, list[int]]:
    """Run attn-export ``args`` until ``workers`` of its pool run, then send it ``sig``: its
    exit status and the pids of its workers."""
    proc = subprocess.Popen([sys.executable, "-m", "attn_export", *args], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(pids := _workers(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) >= workers, f"{workers} workers never started"
        proc.send_signal(sig)
        return proc.wait(timeout=10), pids
    finally:
        proc.kill()


def _gone(pids: Sequence[int], within_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still running after ``within_s`` seconds, killed then."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_stopped_build_leaves_no_worker_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM to build --jobs 2 left its workers running (holding ~870 MB) and writing staged
    files into the folder after the build had died. SIGTERM now ends them before the build
    cleans up; SIGKILL leaves the build no time, and the workers end themselves."""
    specs = [str(tiny_spec(tmp_path / "models", name)) for name in ("a", "b")]
    out = tmp_path / "out"
    status, pids = _stopped(["build", *specs, "--out", str(out), "--jobs", "2"], sig, workers=2)
    left = _names(out)  # none where the build, stopped before it wrote anything, left no folder
    assert status == (128 + sig if sig == signal.SIGTERM else -sig)
    assert _gone(pids) == []
    assert _names(out) == left  # nothing written after the build died
    if sig == signal.SIGTERM:  # the build cleaned up after its workers had ended
        assert not [name for name in left if name.endswith((".staged", ".tmp"))], left


@needs_proc
def test_a_stopped_verify_leaves_no_worker_behind(tiny_build: Built) -> None:
    args = ["verify", str(tiny_build.out), "--models", str(tiny_build.models), "--no-latency", "--jobs", "2"]
    status, pids = _stopped(args, signal.SIGTERM, workers=1)
    assert status == 128 + signal.SIGTERM
    assert _gone(pids) == []
