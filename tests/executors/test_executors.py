"""Executors: one job runs cells here, --jobs N in other processes, ray names its extra when
missing; a cell's key is the hash of its content."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import UsageError
from attn_export.executors import InlineExecutor, Parallelism, cell_key, open_executor


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
    with pytest.raises(UsageError, match="--jobs 0: give 1 or more, or auto"):
        Parallelism(jobs=0)
    result = CliRunner().invoke(cli, ["verify", str(zoo_dir), "--jobs", "two"])
    assert result.exit_code == 2 and "Invalid value for '--jobs': 'two' is not a number of jobs" in result.output


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
    if importlib.util.find_spec("grpc") is not None:
        return  # Ray Client is installed: it would try to speak to the socket below
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{listening.getsockname()[1]}")
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "cannot join the Ray cluster at $RAY_ADDRESS=ray://" in result.output and "ray[client]" in result.output


def test_the_python_api_takes_the_executor(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import attn_export
    from attn_export.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"--executor ray needs ray"):
        attn_export.verify(zoo_dir, models=zoo_dir.parent, executor="ray")
    with pytest.raises(UsageError, match="--jobs 0"):
        attn_export.verify(zoo_dir, jobs=0)
