"""--threads is bounded (a few per CPU this process may use) for every command that takes it,
before anything is built or run."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.runtimes.timing import THREADS_PER_CPU, usable_cpus
from tests.conftest import Built


@pytest.mark.parametrize("command", ["verify", "bench", "bench-decode"])
def test_too_many_threads_are_refused_before_any_work(shared_tiny: Built, tmp_path: Path, command: str) -> None:
    limit = THREADS_PER_CPU * usable_cpus()
    spec = str(shared_tiny.models / "tiny.toml")
    args = {
        "verify": ["verify", str(shared_tiny.out), "--models", str(shared_tiny.models), "--no-latency"],
        "bench": ["bench", spec, "--out", str(tmp_path / "out")],
        "bench-decode": ["bench", spec, "--out", str(tmp_path / "out"), "--decode"],
    }[command]
    result = CliRunner().invoke(cli, [*args, "--threads", str(limit + 1)])
    assert result.exit_code == 2, result.output
    assert (
        result.output
        == f"Error: --threads {limit + 1}: give 1 to {limit} ({THREADS_PER_CPU} per CPU this process may use)\n"
    )
    assert not (tmp_path / "out").exists()
