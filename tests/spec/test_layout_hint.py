"""A [seq, kv_seq] mask of seq-first inputs reads as key padding by its dims; the error a
causal pattern meets there says how to declare it (layout = "query-key"), and with that
the spec is what the module means."""

from __future__ import annotations

from pathlib import Path

import pytest

from attn_export.errors import SpecError
from attn_export.spec import load_spec
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
name = "attn_mask"
dtype = "bool"
shape = ["seq", "kv_seq"]
mask = "causal"
convention = "ignore"
arg = "attn_mask"
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


def test_a_seq_first_mask_read_as_key_padding_suggests_its_layout(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(write_spec(tmp_path, "seq_first", SEQ_FIRST.replace("{layout}", "")))
    assert "a causal mask needs a query axis; key-padding has none (read from its dims" in str(caught.value)
    assert 'set layout = "query-key"' in str(caught.value)
    spec = load_spec(write_spec(tmp_path, "seq_first", SEQ_FIRST.replace("{layout}", 'layout = "query-key"')))
    ((_, mask),) = spec.masks
    assert mask.layout == "query-key"
