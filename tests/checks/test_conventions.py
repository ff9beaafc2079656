"""Every mask convention builds and verifies through a module that reads it, and a planted
flip (the module reading it the other way) fails the build for that reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, verify_artifacts
from tests.conftest import TINY_ZOO, write_spec

CONVENTION_SPEC = """
module = "tests.user_modules:ConventionAttention"
exporter = "torchscript"  # the fastest exporter: the subject is how the mask is read, not the export
kwargs = {{ hidden = 8, convention = "{convention}", flipped = {flipped} }}

[[inputs]]
name = "x"
shape = ["batch", "seq", 8]
[[inputs]]
name = "kv"
shape = ["batch", "kv_seq", 8]
[[inputs]]
name = "mask"
dtype = "{dtype}"
shape = {shape}
mask = "{pattern}"
convention = "{convention}"

[[outputs]]
name = "y"
shape = ["batch", "seq", 8]

[dims]
batch = {{ min = 1, max = 3 }}
seq = {{ min = 1, max = 12 }}
kv_seq = {{ min = 1, max = 16 }}
"""
#: convention -> mask dtype, layout (by its dims) and pattern
CONVENTIONS = {
    "attend": ("bool", '["batch", "seq", "kv_seq"]', "random"),
    "ignore": ("bool", '["batch", "kv_seq"]', "padding"),
    "additive": ("float32", '["batch", "seq", "kv_seq"]', "causal"),
    "additive-min": ("float32", '["batch", "seq", "kv_seq"]', "left-padding"),
    "binary": ("int64", '["batch", "kv_seq"]', "left-padding"),
}


def _convention_spec(folder: Path, convention: str, flipped: bool) -> Path:
    dtype, shape, pattern = CONVENTIONS[convention]
    body = CONVENTION_SPEC.format(
        convention=convention, flipped=str(flipped).lower(), dtype=dtype, shape=shape, pattern=pattern
    )
    return write_spec(folder, convention.replace("-", "_"), body)


def test_every_convention_builds_and_verifies(tmp_path: Path) -> None:
    specs = [_convention_spec(tmp_path / "models", c, flipped=False) for c in CONVENTIONS]
    summary = build_models(specs, BuildOptions(tmp_path / "out"))
    assert [r.status for r in summary.results] == ["built"] * len(CONVENTIONS), [r.error for r in summary.results]
    manifest = load_manifest(tmp_path / "out")
    report = verify_artifacts(
        tmp_path / "out",
        manifest,
        sorted(manifest.models),
        VerifyOptions(models_dir=tmp_path / "models", latency=False),
    )
    assert report.passed, [r for c in report.failed_cases for r in c.reasons()]
    named = [c for c in report.cases if c.shape.startswith("fully-")]
    assert {c.model for c in named} == set(manifest.models) and all(c.notes for c in named)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_planted_convention_flip_fails_the_build(tmp_path: Path, convention: str) -> None:
    spec = _convention_spec(tmp_path / "models", convention, flipped=True)
    result = build_models([spec], BuildOptions(tmp_path / "out")).results[0]
    assert (result.status, result.failed_stage, result.exit_code) == ("failed", "masks", 2)
    assert f"mask 'mask' read as '{convention}'" in (result.error or "")
    assert "still change output 'y' there" in (result.error or "")
    assert "check its 'convention' and 'layout'" in (result.error or "")


def test_zoo_key_padding_mask_declared_the_wrong_way_exits_2(tmp_path: Path) -> None:
    text = (TINY_ZOO / "torch_mha.toml").read_text()
    write_spec(tmp_path, "torch_mha", text.replace('convention = "ignore"', 'convention = "attend"'))
    result = CliRunner().invoke(cli, ["build", "--models", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "[masks] torch_mha: mask 'key_padding_mask' read as 'attend' (True = attend" in result.output
    assert "keys it hides from the row at batch 0 still change output 'output' there" in result.output
