"""Example sizes never collide, and sweeps cover the shapes that break exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_export.errors import InputError
from attn_export.model_spec import ModelSpec, load_spec, spec_from_dict, spec_paths
from attn_export.model_spec.shapes import example_sizes, golden_points, parse_shapes, sizes_from_feeds, sweep
from tests.conftest import ROOT, ZOO

SPECS = [load_spec(p) for p in spec_paths(ZOO)]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_example_sizes_are_distinct_and_avoid_static_dims(spec) -> None:
    sizes = example_sizes(spec)
    static = {d for t in spec.inputs + spec.outputs for d in t.shape if isinstance(d, int)}
    assert len(set(sizes.values())) == len(sizes)
    assert not set(sizes.values()) & static
    assert all(v >= 2 for v in sizes.values())


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_sweep_covers_min_max_and_unequal_lengths(spec) -> None:
    points = sweep(spec)
    assert len(points) >= 6
    sizes = [p.sizes for p in points]
    assert {k: r.min for k, r in spec.dims.items()} in sizes
    assert {k: r.max for k, r in spec.dims.items()} in sizes
    if "kv_seq" in spec.dims:
        assert any(s["seq"] != s["kv_seq"] for s in sizes)
    assert sweep(spec) == points  # seeded
    for s in sizes:
        assert all(spec.dims[k].min <= v <= spec.dims[k].max for k, v in s.items())


def test_sweep_cap_bounds_every_size() -> None:
    spec = SPECS[0]
    assert all(v <= 8 for p in sweep(spec, cap=8) for v in p.sizes.values())


def test_golden_points_include_batch_one_and_unequal_lengths() -> None:
    spec = next(s for s in SPECS if s.name == "mha_cross")
    sizes = [p.sizes for p in golden_points(spec)]
    assert {"batch": 1, "seq": 1, "kv_seq": 1} in sizes
    assert any(s["seq"] != s["kv_seq"] for s in sizes)
    assert max(s["kv_seq"] for s in sizes) >= 64


def test_a_spec_and_its_copy_in_a_manifest_record_the_same_golden_cases() -> None:
    """A manifest holds its spec with the dims sorted by name. The long point kept the first
    declared dim at its least: for the decode benchmark's model a corner at build, a shape
    of its own at verify, so ``verify --golden`` refused every build of it as lacking it."""
    spec = load_spec(ROOT / "benchmarks" / "models" / "mha_kv_cache_512.toml")
    copy = spec_from_dict(json.loads(json.dumps(spec.to_dict(), sort_keys=True)))
    assert list(copy.dims) != list(spec.dims)  # the copy's order is not the spec's

    def labels(s: ModelSpec) -> set[str]:  # what verify asks the golden file for
        return {p.label for p in golden_points(s)}

    def long(s: ModelSpec) -> dict[str, int]:
        return next(p.sizes for p in golden_points(s) if p.label == "long")

    assert labels(copy) == labels(spec) and "long" in labels(spec)
    assert long(copy) == long(spec) == {"past_seq": 64, "seq": 64, "batch": 1, "total_seq": 128}


def test_parse_shapes() -> None:
    assert parse_shapes("batch=1,seq=3;batch=2,seq=5") == [{"batch": 1, "seq": 3}, {"batch": 2, "seq": 5}]
    with pytest.raises(InputError, match=r"cannot read 'seq'; expected NAME=SIZE"):
        parse_shapes("batch=1,seq")
    with pytest.raises(InputError, match=r"cannot read 'batch=²'; expected NAME=SIZE"):
        parse_shapes("batch=²")  # a digit to str.isdigit, not to int()


def test_sizes_from_feeds_refuses_one_dim_with_two_sizes() -> None:
    spec = next(s for s in SPECS if s.name == "mha")
    shapes = {"query": (2, 5, 256), "keys": (2, 6, 256), "values": (2, 5, 256)}
    with pytest.raises(InputError, match=r"dim 'seq' has two sizes: 5 and 6 \(input 'keys', axis 1\)"):
        sizes_from_feeds(spec.inputs, shapes)


def test_named_mask_cases_come_last_and_only_where_they_apply() -> None:
    by_name = {s.name: s for s in SPECS}
    assert [p.case for p in sweep(by_name["mha"])] == ["pattern"] * len(sweep(by_name["mha"]))
    tail = sweep(by_name["mha_causal"])[-2:]
    assert [(p.label, p.case) for p in tail] == [("fully-masked-row",) * 2, ("fully-padded-sequence",) * 2]
    assert tail[0].sizes == example_sizes(by_name["mha_causal"])
    # key padding, or a query dim broadcast as 1: a masked row is a padded sequence, run once
    for name in ("torch_mha", "bert_attention"):
        assert [p.case for p in sweep(by_name[name]) if p.case != "pattern"] == ["fully-padded-sequence"], name
    assert [p.case for p in golden_points(by_name["llama_attention"])][-2:] == list(
        ("fully-masked-row", "fully-padded-sequence")
    )


def test_an_extend_batch_spec_and_its_copy_in_a_manifest_record_the_same_points(tmp_path: Path) -> None:
    """Each point at its sizes, not only its label: a cache fed several new tokens at batch 1
    adds a generator's step, which folds into whichever point has its sizes; recorded in the
    spec's order, a Qwen2's golden file lacked ``step`` at verify and could never be used."""
    lm = ROOT / "tests" / "models" / "llama_causal_lm.toml"
    (tmp_path / lm.name).write_text(lm.read_text() + "\n[cache]\nmax_seq = 40\nextend_batch = 1\n")
    spec = load_spec(tmp_path / lm.name)
    copy = spec_from_dict(json.loads(json.dumps(spec.to_dict(), sort_keys=True)))
    assert list(copy.dims) != list(spec.dims)

    def points(s: ModelSpec) -> dict[str, dict[str, int]]:  # a corner's label follows the dims' order
        return {p.label: p.sizes for p in golden_points(s) if not p.label.startswith("corner-")}

    def corners(s: ModelSpec) -> list[dict[str, int]]:
        return sorted(
            (p.sizes for p in golden_points(s) if p.label.startswith("corner-")), key=lambda d: sorted(d.items())
        )

    assert points(copy) == points(spec) and "step" in points(spec) and corners(copy) == corners(spec)


def test_a_guard_on_a_corner_keeps_the_points_verify_asks_a_golden_file_for() -> None:
    """Dims declared seq then batch: a guard's point (seq 1 at the export's batch) is a
    corner, and the corner's label, kept or folded, follows the dims' order, which the
    manifest's copy sorts: verify asked for a label build never wrote. A golden case is
    matched by what it holds (``verify.models.missing_cases``), the same in both orders."""
    import dataclasses

    from attn_export.artifacts.golden import GoldenCase
    from attn_export.model_spec import Guard
    from attn_export.model_spec.distributions import case_label
    from attn_export.model_spec.shapes import golden_plan
    from attn_export.pipelines.verify.models import missing_cases

    spec = load_spec(ROOT / "tests" / "models" / "mha.toml")
    dims = {"seq": spec.dims["seq"], "batch": dataclasses.replace(spec.dims["batch"], max=3)}
    spec = dataclasses.replace(spec, typical={**spec.typical, "batch": 3}, dims=dims)
    spec = dataclasses.replace(spec, guards=(Guard("Ne(seq, 1)", "", ({**example_sizes(spec), "seq": 1},)),))
    copy = spec_from_dict(json.loads(json.dumps(spec.to_dict(), sort_keys=True)))

    def labels(s: ModelSpec) -> set[str]:
        return {case_label(p.label, d) for p, d in golden_plan(s)}

    built = [GoldenCase(case_label(p.label, d), dict(p.sizes)) for p, d in golden_plan(spec)]  # as build records
    assert labels(copy) != labels(spec) and missing_cases(copy, built) == []
    assert missing_cases(copy, built[1:]) == ["distinct"]  # a file cut short still lacks what it lacks
