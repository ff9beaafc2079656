"""The one data loader: every mask pattern, layout, convention and named case is what its
name says, patterns never mask a whole row, and seeds reproduce."""

from __future__ import annotations

import numpy as np
import pytest

from attn_export.model_spec import TensorSpec
from attn_export.model_spec.inputs import make_tensor
from attn_export.model_spec.masks import CONVENTIONS, PATTERNS, MaskSpec, masked_row_selector

SIZES = {"batch": 3, "seq": 5, "kv_seq": 7}
SHAPES = {
    "batch-heads-query-key": ("batch", 1, "seq", "kv_seq"),
    "batch-query-key": ("batch", "seq", "kv_seq"),
    "query-key": ("seq", "kv_seq"),
    "key-padding": ("batch", "kv_seq"),
}


def _mask(
    kind: str, case: str = "pattern", layout: str = "batch-heads-query-key", convention: str = "attend"
) -> np.ndarray:
    dtype = CONVENTIONS[convention].dtypes[0]
    t = TensorSpec("mask", dtype, SHAPES[layout], MaskSpec(kind, layout, CONVENTIONS[convention]))
    return make_tensor(t, SIZES, np.random.default_rng(0), case=case)


def test_causal_mask_is_lower_triangular_in_every_batch_element() -> None:
    mask = _mask("causal")
    assert mask.shape == (3, 1, 5, 7) and mask.dtype == bool
    for b in range(3):
        np.testing.assert_array_equal(mask[b, 0], np.tril(np.ones((5, 7), dtype=bool)))
    np.testing.assert_array_equal(_mask("causal", layout="query-key"), np.tril(np.ones((5, 7), dtype=bool)))


@pytest.mark.parametrize("kind", ["padding", "left-padding"])
def test_padding_keeps_a_nonempty_run_of_keys_at_its_end_per_batch_element(kind: str) -> None:
    for layout in ("batch-heads-query-key", "key-padding"):
        mask = _mask(kind, layout=layout).reshape(3, -1, 7)
        lengths = set()
        for b in range(3):
            row = mask[b, 0]
            n = int(row.sum())
            lengths.add(n)
            want = np.arange(7) < n if kind == "padding" else np.arange(7) >= 7 - n
            np.testing.assert_array_equal(row, want)
            assert (mask[b] == row).all()  # every query sees the same keys
        assert len(lengths) > 1, layout  # lengths differ across the batch


def test_random_mask_is_mixed_seeded_and_never_masks_a_whole_row() -> None:
    mask = _mask("random")
    assert 0.5 < mask.mean() < 0.95
    np.testing.assert_array_equal(mask, _mask("random"))
    tiny = make_tensor(
        TensorSpec("m", "bool", ("batch", "kv_seq"), MaskSpec("random", "key-padding", CONVENTIONS["attend"])),
        {"batch": 64, "kv_seq": 1},
        np.random.default_rng(0),
    )
    assert tiny.all()  # one key: it must be kept, whatever the draw


@pytest.mark.parametrize("kind", PATTERNS)
def test_no_pattern_has_a_fully_masked_row(kind: str) -> None:
    for layout in SHAPES:
        if kind == "causal" and layout == "key-padding":
            continue
        assert _mask(kind, layout=layout).any(axis=-1).all(), (kind, layout)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_each_convention_encodes_the_same_keys_its_own_way(convention: str) -> None:
    keep = _mask("padding")
    values = _mask("padding", convention=convention)
    np.testing.assert_array_equal(CONVENTIONS[convention].keep(values), keep)
    want = {
        "attend": keep,
        "ignore": ~keep,
        "additive": np.where(keep, 0.0, -np.inf),
        "additive-min": np.where(keep, 0.0, np.finfo(np.float32).min),
        "binary": keep.astype(np.int32),
    }[convention]
    np.testing.assert_array_equal(values, want)


def test_fully_masked_row_masks_exactly_the_last_query_of_the_first_element() -> None:
    for kind in ("causal", "padding", "random"):
        plain, masked = _mask(kind), _mask(kind, "fully-masked-row")
        assert not masked[0, 0, 4].any(), kind
        changed = plain != masked
        assert changed[0, 0, 4].any() and not changed[0, 0, :4].any() and not changed[1:].any(), kind


def test_fully_padded_sequence_masks_exactly_the_first_element() -> None:
    for layout in ("batch-heads-query-key", "key-padding"):
        plain, padded = _mask("padding", layout=layout), _mask("padding", "fully-padded-sequence", layout=layout)
        assert not padded[0].any() and (padded[1:] == plain[1:]).all(), layout
    ignore = _mask("padding", "fully-padded-sequence", layout="key-padding", convention="ignore")
    assert ignore[0].all()  # True = ignore: every key of the first element ignored


def test_masked_rows_map_to_output_elements_by_dim_name() -> None:
    keep = _mask("padding", "fully-masked-row")
    sel = masked_row_selector(
        "batch-heads-query-key", SHAPES["batch-heads-query-key"], keep, ("batch", "seq", 8), (3, 5, 8)
    )
    assert sel[0, 4].all() and sel.sum() == 8
    weights = masked_row_selector(
        "batch-heads-query-key", SHAPES["batch-heads-query-key"], keep, ("batch", 4, "seq", "kv_seq"), (3, 4, 5, 7)
    )
    assert weights[0, :, 4].all() and weights.sum() == 4 * 7
    padded = _mask("padding", "fully-padded-sequence", layout="key-padding")
    sel = masked_row_selector("key-padding", SHAPES["key-padding"], padded, ("batch", "seq", 8), (3, 5, 8))
    assert sel[0].all() and sel.sum() == 5 * 8  # every query of the padded sequence
    pooled = masked_row_selector("key-padding", SHAPES["key-padding"], padded, (8,), (8,))
    assert pooled.all()  # an output without the batch dim counts as wholly affected


@pytest.mark.parametrize("name", ["position_ids", "positions", "cache_position"])
def test_position_ids_are_drawn_over_every_position_a_case_can_hold(name: str) -> None:
    """From 0..7, a rotary capped at some length passed; a decoder's positions reach past the
    cache's length, a module's without a cache its sequence's, under any of their names."""
    from attn_export.model_spec import spec_from_dict
    from attn_export.model_spec.inputs import int_values

    def spec(cache: bool) -> dict[str, object]:
        past = [{"name": f"past_key_values.0.{kv}", "shape": ["batch", 2, "past", 4]} for kv in ("key", "value")]
        present = [{"name": f"present.0.{kv}", "shape": ["batch", 2, "total", 4]} for kv in ("key", "value")]
        return {
            "name": "m",
            "module": "m:M",
            "inputs": [
                {"name": "x", "shape": ["batch", "seq", 8]},
                {"name": name, "dtype": "int64", "shape": ["batch", "seq"]},
                {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                *(past if cache else []),
            ],
            "outputs": [{"name": "y", "shape": ["batch", "seq", 8]}, *(present if cache else [])],
            "dims": {"batch": {"min": 1, "max": 2}, "seq": {"min": 1, "max": 12}}
            | ({"past": {"min": 0, "max": 30}, "total": "past + seq"} if cache else {}),
        }

    for cache, top in ((True, 41), (False, 11)):
        built = spec_from_dict(spec(cache))
        positions, types = built.inputs[1], built.inputs[2]
        assert int_values(built, positions) == (0, top) and int_values(built, types) == (0, 7)


def test_a_named_case_changes_only_the_masks_it_applies_to() -> None:
    """nn.MultiheadAttention's [seq, seq] causal attn_mask beside its key_padding_mask: the
    padded sequence once masked the causal mask whole too, every row then had no key, and
    under fully_masked = "ignore" the case compared nothing and passed."""
    from attn_export.model_spec import spec_from_dict
    from attn_export.model_spec.inputs import make_feeds

    ignore = {"dtype": "bool", "convention": "ignore"}
    spec = spec_from_dict(
        {
            "name": "m",
            "module": "m:M",
            "inputs": [
                {"name": "x", "shape": ["batch", "seq", 8]},
                {"name": "attn_mask", "shape": ["seq", "seq"], "mask": "causal", **ignore},
                {"name": "key_padding_mask", "shape": ["batch", "seq"], "mask": "padding", **ignore},
            ],
            "outputs": [{"name": "y", "shape": ["batch", "seq", 8]}],
            "dims": {"batch": {"min": 1, "max": 3}, "seq": {"min": 1, "max": 8}},
        }
    )
    feeds = make_feeds(spec, {"batch": 3, "seq": 5}, 0, case="fully-padded-sequence")
    assert (feeds["attn_mask"] == ~np.tri(5, dtype=bool)).all()  # its causal pattern, True = ignore
    assert feeds["key_padding_mask"][0].all() and not feeds["key_padding_mask"][1:].all()
