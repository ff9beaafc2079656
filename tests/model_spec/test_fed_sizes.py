"""A cache that takes several new tokens on a filled cache only at batch 1 (``[cache]
extend_batch``, onnxruntime-genai's GroupQueryAttention on CPU) and a mask that never pads
(``mask = "full"``): the sweep, the golden points and the sizes a user gives are what such a
graph is fed, and nothing a padded batch or a named mask case needs is asked of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attn_export.errors import InputError
from attn_export.model_spec import load_spec
from attn_export.model_spec.cache import cache_of, fed_sizes
from attn_export.model_spec.masks import fill_mask
from attn_export.model_spec.shapes import golden_points, mask_cases, sweep, validate_sizes
from tests.conftest import TINY_ZOO

LM = (TINY_ZOO / "llama_causal_lm.toml").read_text()


def _spec(tmp_path: Path, text: str):  # noqa: ANN202 - a ModelSpec
    path = tmp_path / "llama_causal_lm.toml"
    path.write_text(text)
    return load_spec(path)


def _several_on_filled(sizes: dict[str, int]) -> bool:
    return sizes["past_seq"] > 0 and sizes["seq"] > 1 and sizes["batch"] > 1


def test_extend_batch_feeds_several_new_tokens_on_a_filled_cache_at_batch_1(tmp_path: Path) -> None:
    plain = _spec(tmp_path, LM)
    spec = _spec(tmp_path, LM + "\n[cache]\nextend_batch = 1\n")
    assert any(_several_on_filled(p.sizes) for p in sweep(plain))  # what the refusal would meet
    points = sweep(spec)
    assert not any(_several_on_filled(p.sizes) for p in [*points, *golden_points(spec)])
    by_label = {p.label: p.sizes for p in points}
    # the generator's own steps at the largest batch stay in the sweep
    assert by_label["prompt"]["batch"] == by_label["step"]["batch"] == spec.dims["batch"].max
    assert by_label["prompt"]["past_seq"] == 0 and by_label["step"]["seq"] == 1
    assert fed_sizes(spec, {"batch": 3, "seq": 4, "past_seq": 2})["batch"] == 1
    assert cache_of(spec).extend_batch == 1  # type: ignore[union-attr]
    assert spec.to_dict()["cache"] == {"extend_batch": 1}


def test_sizes_given_beyond_extend_batch_are_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path, LM + "\n[cache]\nextend_batch = 1\n")
    validate_sizes(spec, {"batch": 3, "seq": 1, "past_seq": 5})
    validate_sizes(spec, {"batch": 3, "seq": 4, "past_seq": 0})
    said = r"batch=3 with seq=4 new tokens on a filled cache \(past_seq=2\).*extend_batch"
    with pytest.raises(InputError, match=said):
        validate_sizes(spec, {"batch": 3, "seq": 4, "past_seq": 2})


def test_a_full_mask_keeps_every_key_and_has_no_named_case(tmp_path: Path) -> None:
    padded = _spec(tmp_path, LM)
    spec = _spec(tmp_path, LM.replace('mask = "left-padding"', 'mask = "full"'))
    assert mask_cases(padded) and not mask_cases(spec)
    ((tensor, mask),) = spec.masks
    values = fill_mask(mask, "int64", (3, 7), np.random.default_rng(0), "fully-padded-sequence")
    assert (values == 1).all()
    assert cache_of(spec).pads is False and cache_of(padded).pads is True  # type: ignore[union-attr]
