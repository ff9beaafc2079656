"""Scenario presets: each is the documented shapes and steps for a decoder, refused (never
clamped) where a spec's ranges cannot hold it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attn_export.errors import InputError, UsageError
from attn_export.model_spec import DimRange, load_spec
from attn_export.model_spec.scenarios import SCENARIOS, scenario_sizes
from tests.conftest import ROOT, TINY_ZOO, ZOO

#: (batch, seq, past) of each step for the zoo's decoders (past_seq up to 256).
EXPECTED = {
    "prefill-cold": [(1, 16, 0)],
    "decode-early": [(1, 1, p) for p in range(16, 24)],
    "decode-deep": [(1, 1, p) for p in range(249, 257)],
    "speculative": [(1, 4, 20)],
    "batch-prefill": [(4, 16, 0)],
    "batch-decode": [(4, 1, p) for p in range(16, 24)],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_scenario_is_its_documented_steps(name: str) -> None:
    spec = load_spec(ZOO / "gqa_rope_kv_cache.toml")
    steps = scenario_sizes(spec, name)
    assert [(s["batch"], s["seq"], s["past_seq"]) for s in steps] == EXPECTED[name]
    assert all(s["total_seq"] == s["past_seq"] + s["seq"] for s in steps)
    assert SCENARIOS[name].describe() in (ROOT / "docs" / "decoders.md").read_text()


def test_decode_deep_ends_at_the_top_of_each_spec_range() -> None:
    steps = scenario_sizes(load_spec(TINY_ZOO / "mha_kv_cache.toml"), "decode-deep")  # past_seq max 24
    assert [s["past_seq"] for s in steps] == list(range(17, 25))


def test_a_scenario_outside_the_ranges_is_refused_naming_the_dim() -> None:
    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    narrow = dataclasses.replace(spec, dims={**spec.dims, "seq": DimRange(1, 8)})
    with pytest.raises(InputError) as e:
        scenario_sizes(narrow, "prefill-cold")
    assert str(e.value) == (
        "--scenario prefill-cold (batch 1, 1 step of 16 query tokens from past 0): "
        "mha_kv_cache: seq=16 is outside its declared range [1, 8]"
    )


def test_a_model_without_a_cache_has_no_scenario(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^mha: --scenario speculative needs a decoder with a key/value cache"):
        scenario_sizes(load_spec(ZOO / "mha.toml"), "speculative")
