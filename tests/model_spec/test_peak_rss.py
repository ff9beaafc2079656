"""Every entry point refuses a case over the memory budget before allocating it, measured:
each runs in a fresh process on a case that needs gigabytes, and its peak resident memory
stays near what importing its dependencies costs.

The bound is the same for all, ``BOUND`` (1.5 GiB): well above what an entry point costs
before it refuses (its imports: 50 MiB for bench, which refuses before importing torch, up
to 350 MiB for build) and well below what the case takes once allocated. With the budget
check removed, each of them passes 2.3 GiB (PyTorch's attention scores in float32 and
float64), so a refusal that comes after the case's allocation fails here; what it does
not catch is an allocation of less than about 1 GiB before the refusal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from attn_export.model_spec.memory import format_bytes
from tests.conftest import TINY_MHA, TINY_ZOO, Built, edit_spec, peak_rss, tiny_spec

#: The budget each entry point runs under, and the peak RSS a refusal must stay below.
BUDGET, BOUND = "64MiB", 3 << 29
#: The tiny spec's lengths, widened so that its largest case needs 264 MiB at least and
#: over 2 GiB in practice (batch 4, 2 heads, 4096 x 4096 scores).
WIDE = {
    "seq = { min = 1, max = 24 }": "seq = { min = 1, max = 4096 }",
    "kv_seq = { min = 1, max = 40 }": "kv_seq = { min = 1, max = 4096 }",
}
REFUSED = "needs at least 264.0 MiB, over the memory budget of 64.0 MiB"
CLI = [sys.executable, "-m", "attn_export"]


@pytest.fixture
def wide_build(tiny_build: Built) -> Built:
    """``tiny_build`` with its spec's lengths widened (``WIDE``), recorded as a build of it."""
    edit_spec(tiny_build.out, tiny_build.models, "tiny", WIDE)
    return tiny_build


def _refused_below_bound(args: list[str], message: str, code: int, cwd: Path, **kwargs: object) -> None:
    done, peak = peak_rss(args, cwd=cwd, **kwargs)
    output = done.stdout + done.stderr
    assert done.returncode == code, output
    assert message in output and "Traceback" not in output, output
    assert peak < BOUND, f"peak RSS {format_bytes(peak)}, over {format_bytes(BOUND)}: the case was allocated"


def _widened(text: str) -> str:
    for old, new in WIDE.items():
        text = text.replace(old, new)
    return text


def test_verify_refuses_before_allocating(wide_build: Built, tmp_path: Path) -> None:
    args = [*CLI, "verify", str(wide_build.out), "--models", str(wide_build.models), "--no-latency"]
    _refused_below_bound([*args, "--max-memory", BUDGET], REFUSED, 2, tmp_path)


@pytest.mark.slow  # a process each: make test measures verify and bench
def test_build_refuses_before_allocating(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path / "models", exporter="torchscript", body=_widened(TINY_MHA))
    args = [*CLI, "build", str(spec), "--out", str(tmp_path / "out"), "--max-memory", BUDGET]
    _refused_below_bound(args, "over the memory budget of 64.0 MiB", 2, tmp_path)


def test_bench_refuses_before_allocating(tmp_path: Path) -> None:
    args = [*CLI, "bench", str(TINY_ZOO / "mha.toml"), "--out", str(tmp_path / "out"), "--batch", "4"]
    message = "over the memory budget of 64.0 MiB"
    _refused_below_bound([*args, "--seq", "8,4096", "--max-memory", BUDGET], message, 2, tmp_path)


API = """
import sys

import attn_export
from attn_export.errors import InputError

try:
    attn_export.verify(sys.argv[1], models=sys.argv[2], max_memory=sys.argv[3])
except InputError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.slow  # a process each: make test measures verify and bench
def test_the_api_refuses_before_allocating(wide_build: Built, tmp_path: Path) -> None:
    args = [sys.executable, "-c", API, str(wide_build.out), str(wide_build.models), BUDGET]
    _refused_below_bound(args, REFUSED, 3, tmp_path)


@pytest.mark.slow  # a process each: make test measures verify and bench
def test_the_plugin_refuses_before_allocating(wide_build: Built, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "pytest", "--attn-export", str(wide_build.out), "-p", "no:cacheprovider", "-q"]
    args += ["--attn-export-models", str(wide_build.models), "--attn-export-max-memory", BUDGET]
    _refused_below_bound(args, REFUSED, 1, tmp_path)
