"""verify --scenario: a preset's steps replace the sweep for the decoders of a folder, the
others left out with a note; what cannot combine with it is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.model_spec.cache import cache_of
from tests.conftest import TINY_ZOO

TINY = ("--models", str(TINY_ZOO))


def test_a_scenario_verifies_every_decoder_at_its_steps(zoo_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    args = ["verify", str(zoo_dir), *TINY, "--scenario", "speculative", "--distribution", "normal", "--no-latency"]
    result = CliRunner().invoke(cli, [*args, "--json", str(report)])
    assert result.exit_code == 0, result.output
    models = load_manifest(zoo_dir).models
    decoders = sorted(n for n, e in models.items() if cache_of(e.model_spec) is not None)
    others = sorted(set(models) - set(decoders))
    assert len(decoders) >= 2 and others
    assert f"note: --scenario speculative runs decoders only: leaving out {', '.join(others)}" in result.output
    doc = json.loads(report.read_text())
    assert doc["settings"]["scenario"] == "speculative" and doc["decode"] == []
    assert sorted(c["model"] for c in doc["cases"]) == decoders
    assert {(c["shape"], c["sizes"]["batch"], c["sizes"]["seq"], c["sizes"]["past_seq"]) for c in doc["cases"]} == {
        ("speculative-1", 1, 4, 20)
    }


def test_a_scenario_replaces_the_sweep_and_needs_a_decoder(zoo_dir: Path) -> None:
    runner = CliRunner()
    shapes = runner.invoke(cli, ["verify", str(zoo_dir), *TINY, "--scenario", "decode-deep", "--shapes", "batch=1"])
    assert shapes.exit_code == 2
    assert shapes.output == "Error: --scenario replaces the sweep: it cannot be combined with --shapes\n"
    plain = runner.invoke(cli, ["verify", str(zoo_dir / "mha.onnx"), *TINY, "--scenario", "decode-deep"])
    assert plain.exit_code == 2
    assert plain.output == "Error: --scenario decode-deep: none of mha has a key/value cache\n"
