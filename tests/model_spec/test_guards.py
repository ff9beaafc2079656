"""Accepted guards travel with the built spec: the manifest's copy keeps them, a spec file
cannot set them, and every sweep and golden set runs the sizes where they fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attn_export.artifacts.manifest import load_manifest
from attn_export.errors import SpecError
from attn_export.model_spec import Guard, load_spec, spec_from_dict
from attn_export.model_spec.shapes import golden_points, sweep
from attn_export.pipelines.verify.models import checkout_spec
from tests.conftest import TINY_ZOO, needs_transformers, tiny_spec

SEVEN = Guard("seq != 7", "modules.py:12 `if q.shape[1] == 7:`", ({"kv_seq": 5, "seq": 7, "batch": 2},))


def test_guards_survive_the_manifest_and_leave_the_hash_alone(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path))
    built = dataclasses.replace(spec, guards=(SEVEN,))
    again = spec_from_dict(built.to_dict())
    assert again.guards == (SEVEN,)
    assert built.content_hash() == spec.content_hash()  # learnt from the export, not a cause of it


def test_a_spec_file_cannot_declare_guards(tmp_path: Path) -> None:
    path = tiny_spec(tmp_path)
    path.write_text('guards = [{ condition = "seq != 7", points = [] }]\n' + path.read_text())
    with pytest.raises(SpecError, match="unknown key 'guards'"):
        load_spec(path)


def test_a_guard_point_outside_the_range_is_refused(tmp_path: Path) -> None:
    raw = load_spec(tiny_spec(tmp_path)).to_dict()
    raw["guards"] = [{"condition": "seq != 70", "where": "", "points": [{"batch": 2, "seq": 70, "kv_seq": 5}]}]
    with pytest.raises(SpecError, match="guard 'seq != 70': seq=70 is outside its declared range"):
        spec_from_dict(raw)


def test_sweeps_and_golden_sets_run_where_a_guard_fails(tmp_path: Path) -> None:
    spec = dataclasses.replace(load_spec(tiny_spec(tmp_path)), guards=(SEVEN,))
    for points in (sweep(spec), golden_points(spec)):
        (guard,) = [p for p in points if p.label.startswith("guard")]
        assert (guard.label, list(guard.sizes.items())) == ("guard-1", [("batch", 2), ("seq", 7), ("kv_seq", 5)])
    assert SEVEN.fails_at({"batch": 2, "seq": 7, "kv_seq": 5}) and not SEVEN.fails_at(
        {"batch": 2, "seq": 6, "kv_seq": 5}
    )


@needs_transformers
def test_the_sdpa_decoder_records_the_guard_it_was_built_past(zoo_dir: Path) -> None:
    """transformers' sdpa attention takes another path for one query token: the tiny zoo's
    build records the guard, golden-checks it, and verify's spec carries it into the sweep."""
    entry = load_manifest(zoo_dir).models["llama_sdpa_kv_cache"]
    (seq_one,) = [g for g in entry.model_spec.guards if g.condition == "seq != 1"]
    assert seq_one.where.startswith("transformers/integrations/sdpa_attention.py:")
    assert seq_one.points == ({"batch": 3, "seq": 1, "past_seq": 7},)
    spec = checkout_spec(TINY_ZOO, entry)
    assert spec.guards == entry.model_spec.guards
    assert {"batch": 3, "seq": 1, "past_seq": 7, "total_seq": 8} in [p.sizes for p in sweep(spec)]
