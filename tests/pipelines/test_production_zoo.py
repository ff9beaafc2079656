"""The production zoo: models/ at its own sizes, built and verified as `make demo` does.
Every other test uses the tiny zoo of tests/models; this one runs one of its models by
default and the whole zoo in the slow run."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import ZOO, buildable, zoo_cases

#: The production zoo's model the default run builds and verifies: a decoder, with its
#: decode trajectories at the full past length.
SAMPLE = ("mha_kv_cache",)


@pytest.mark.parametrize(
    "names", [pytest.param(SAMPLE, id="sample"), pytest.param((), id="whole", marks=pytest.mark.slow)]
)
def test_the_production_zoo_builds_and_verifies(tmp_path: Path, names: tuple[str, ...]) -> None:
    specs = [ZOO / f"{n}.toml" for n in names] if names else buildable(ZOO)
    names = tuple(p.stem for p in specs)
    out = tmp_path / "build"
    build = CliRunner().invoke(cli, ["build", *names, "--models", str(ZOO), "--out", str(out)])
    assert build.exit_code == 0, build.output
    assert build.output.splitlines()[-1].startswith(f"{len(specs)} graphs: {len(specs)} built, 0 skipped, 0 failed")
    verify = CliRunner().invoke(cli, ["verify", str(out), "--models", str(ZOO), "--no-latency"])
    assert verify.exit_code == 0, verify.output
    cases = zoo_cases(out, specs)
    assert f"verify PASSED: {cases} of {cases} cases agree across {len(specs)} models" in verify.output
