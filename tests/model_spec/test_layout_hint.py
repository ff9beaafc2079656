"""A 2-D mask's layout is read from which inputs hold its dims, batch-first or seq-first:
``[batch, kv_seq]`` is key padding, ``[seq, kv_seq]`` is query-key. Where no input holds
the key dim, its first dim is taken for the batch when it is the first input's first dim;
the error a causal pattern meets there says how to declare it (layout = "query-key")."""

from __future__ import annotations

from pathlib import Path

import pytest

from attn_export.errors import SpecError
from attn_export.model_spec import load_spec
from attn_export.model_spec.masks import default_layout
from attn_export.model_spec.shapes import mask_cases
from tests.conftest import write_spec

SEQ_FIRST = """
module = "torch.nn:MultiheadAttention"
kwargs = { embed_dim = 16, num_heads = 2 }
call = { need_weights = false }
[[inputs]]
name = "query"
shape = ["seq", "batch", 16]
[[inputs]]
name = "key"
shape = ["kv_seq", "batch", 16]
[[inputs]]
name = "value"
shape = ["kv_seq", "batch", 16]
[[inputs]]
name = "mask"
dtype = "bool"
shape = {mask}
mask = "{pattern}"
convention = "ignore"
arg = "{arg}"
{layout}
[[outputs]]
name = "output"
shape = ["seq", "batch", 16]
pick = 0
[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 12 }
kv_seq = { min = 1, max = 16 }
"""


def _spec(tmp_path: Path, mask: str, pattern: str, arg: str, extra: str = "") -> Path:
    """The seq-first spec with its mask shaped ``mask``; ``extra``: lines after the mask's."""
    fields = {"{mask}": mask, "{pattern}": pattern, "{arg}": arg, "{layout}": extra}
    text = SEQ_FIRST
    for key, value in fields.items():
        text = text.replace(key, value)
    return write_spec(tmp_path, "seq_first", text)


@pytest.mark.parametrize(
    ("mask", "pattern", "arg", "layout"),
    [
        ('["seq", "kv_seq"]', "causal", "attn_mask", "query-key"),
        ('["batch", "kv_seq"]', "padding", "key_padding_mask", "key-padding"),
        ('["batch", "seq"]', "padding", "key_padding_mask", "key-padding"),
        ('["seq", "seq"]', "causal", "attn_mask", "query-key"),
    ],
)
def test_a_seq_first_masks_layout_is_read_from_the_inputs_holding_its_dims(
    tmp_path: Path, mask: str, pattern: str, arg: str, layout: str
) -> None:
    spec = load_spec(_spec(tmp_path, mask, pattern, arg))
    ((_, read),) = spec.masks
    assert read.layout == layout
    # a mask without a batch axis pads every sequence at once: under fully_masked = "ignore"
    # that case would compare nothing, and pass
    assert mask_cases(spec) == (["fully-masked-row"] if layout == "query-key" else ["fully-padded-sequence"])


def test_a_mask_whose_dims_cannot_tell_suggests_its_layout(tmp_path: Path) -> None:
    """The mask's key dim is in no other input: its first dim, the query's first, is taken for the batch."""
    length = "[dims.mask_len]\nmin = 1\nmax = 16\n"
    with pytest.raises(SpecError) as caught:
        load_spec(_spec(tmp_path, '["seq", "mask_len"]', "causal", "attn_mask", length))
    assert "a causal mask needs a query axis; key-padding has none (read from its dims" in str(caught.value)
    assert 'set layout = "query-key"' in str(caught.value)
    declared = _spec(tmp_path, '["seq", "mask_len"]', "causal", "attn_mask", 'layout = "query-key"\n' + length)
    ((_, mask),) = load_spec(declared).masks
    assert mask.layout == "query-key"


def test_an_input_holding_both_dims_past_its_leading_axes_is_no_batch() -> None:
    """A bias ``[batch, heads, seq, kv_seq]`` holds a [seq, kv_seq] mask's dims too; the
    inputs that lead with the key dim say ``seq`` is no batch."""
    others = [("batch", "seq", 64), ("batch", "kv_seq", 64), ("batch", 4, "seq", "kv_seq")]
    assert default_layout(("seq", "kv_seq"), others) == "query-key"
    assert default_layout(("batch", "kv_seq"), others) == "key-padding"


def test_a_mask_of_one_sequence_beside_inputs_of_one_is_key_padding() -> None:
    """``[1, seq]`` beside ``[1, seq, 16]``: the padding of the batch's one sequence, whose
    padded query rows are then found (``checks.fully_masked.padded_query_rows``)."""
    assert default_layout((1, "seq"), [(1, "seq", 16)]) == "key-padding"
    assert default_layout((1, "seq"), [("batch", "seq", 16)]) == "query-key"  # broadcast over a batch
    assert default_layout((1, "seq"), [(1, "seq", 16)], "causal") == "query-key"  # its one query row, as before
