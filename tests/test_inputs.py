"""The one data loader: every mask pattern is what its name says, and seeds reproduce."""

from __future__ import annotations

import numpy as np

from attn_export.spec import TensorSpec
from attn_export.spec.inputs import make_tensor

SIZES = {"batch": 3, "seq": 5, "kv_seq": 7}


def _mask(kind: str, masked_row: bool = False) -> np.ndarray:
    t = TensorSpec("mask", "bool", ("batch", 1, "seq", "kv_seq"), kind)
    return make_tensor(t, SIZES, np.random.default_rng(0), masked_row=masked_row)


def test_causal_mask_is_lower_triangular_in_every_batch_element() -> None:
    mask = _mask("causal")
    assert mask.shape == (3, 1, 5, 7) and mask.dtype == bool
    for b in range(3):
        np.testing.assert_array_equal(mask[b, 0], np.tril(np.ones((5, 7), dtype=bool)))


def test_padding_mask_keeps_a_nonempty_prefix_of_keys_per_batch_element() -> None:
    mask = _mask("padding")
    for b in range(3):
        row = mask[b, 0, 0]
        n = int(row.sum())
        assert 1 <= n <= 7
        np.testing.assert_array_equal(row, np.arange(7) < n)
        assert (mask[b, 0] == row).all()  # every query sees the same keys
    assert len({int(mask[b, 0, 0].sum()) for b in range(3)}) > 1  # lengths differ across the batch


def test_random_mask_is_mixed_and_seeded() -> None:
    mask = _mask("random")
    assert 0.5 < mask.mean() < 0.95
    np.testing.assert_array_equal(mask, _mask("random"))


def test_masked_row_masks_exactly_the_last_query_of_the_first_element() -> None:
    for kind in ("causal", "padding", "random"):
        plain, masked = _mask(kind), _mask(kind, masked_row=True)
        assert not masked[0, 0, 4].any(), kind
        changed = plain != masked
        assert changed[0, 0, 4].any() and not changed[0, 0, :4].any() and not changed[1:].any(), kind
        assert plain.any(axis=-1).all() or kind == "random", kind  # no fully masked row unless asked
