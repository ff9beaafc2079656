"""verify during a rebuild waits for the build (or says one is in progress) instead of
crying tamper at files the build is still writing; a build waits for a verify reading the
folder; a folder copied without its lock file needs none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from click.testing import CliRunner

from attn_export.artifacts.files import LOCK_NAME, build_lock, read_lock
from attn_export.cli import cli
from tests.conftest import Built


def _verify(built: Built, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["verify", str(built.out), "--golden", "--no-latency", *args])


def test_verify_says_a_build_is_in_progress_instead_of_reporting_tampering(tiny_build: Built) -> None:
    with build_lock(tiny_build.out):
        result = _verify(tiny_build, "--wait", "0.2")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        f"Error: {tiny_build.out} is locked by an attn-export build in progress after waiting 0.2 s; "
        "try again when it ends (--wait SECONDS waits longer)"
    )
    assert "changed after the build" not in result.output


def test_verify_waits_for_a_build_to_finish(tiny_build: Built) -> None:
    held = threading.Event()

    def build() -> None:
        with build_lock(tiny_build.out):
            held.set()
            time.sleep(0.5)

    thread = threading.Thread(target=build)
    thread.start()
    held.wait()
    result = _verify(tiny_build, "--wait", "30")
    thread.join()
    assert result.exit_code == 0, result.output
    assert f"note: {tiny_build.out} is locked by an attn-export build in progress; waiting up to 30 s" in result.output


def test_a_build_waits_for_a_verify_reading_the_folder(tiny_build: Built) -> None:
    with read_lock(tiny_build.out):
        args = ["build", "--models", str(tiny_build.models), "--out", str(tiny_build.out), "--wait", "0.2"]
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "is locked by another attn-export build or verify" in result.output


def test_a_folder_without_a_lock_file_is_read_without_one(tiny_build: Built, tmp_path: Path) -> None:
    (tiny_build.out / LOCK_NAME).unlink(missing_ok=True)
    assert _verify(tiny_build).exit_code == 0
    assert not (tiny_build.out / LOCK_NAME).exists()  # verify creates nothing in the folder
