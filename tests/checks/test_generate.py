"""The generation judge: tokens exact, logits within tolerance, rows judged to their end of
sequence and no further, and a runner that stops early or gives NaN does not pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from attn_export.checks.generate import _tie_room, generate_prompts, judge, padding_side, stacked
from attn_export.errors import UsageError
from attn_export.model_spec import Tolerance, load_spec
from attn_export.runtimes.genai import Generation
from tests.conftest import TINY_ZOO, write_spec

TOL = Tolerance(1e-5, 1e-4)
EOS = frozenset({2})


def _logits(tokens: list[list[int]], vocab: int = 8) -> list[np.ndarray]:
    """Each step's logits peaking at each row's token."""
    steps = max(len(row) for row in tokens)
    out = []
    for step in range(steps):
        logits = np.zeros((len(tokens), vocab))
        for row, seq in enumerate(tokens):
            if step < len(seq):
                logits[row, seq[step]] = 1.0
        out.append(logits)
    return out


def _gen(tokens: list[list[int]]) -> Generation:
    return Generation(tokens, _logits(tokens))


def test_the_same_generation_agrees_and_a_row_is_judged_to_its_end() -> None:
    want = _gen([[5, 2, 0, 0], [3, 4, 5, 6]])
    got = _gen([[5, 2, 7, 7], [3, 4, 5, 6]])  # after its eos a row may hold anything
    assert judge(want, got, TOL, EOS)[1:3] == ("", None)


def test_a_row_that_differs_after_another_row_ended_is_still_judged() -> None:
    """PyTorch's generation of each prompt alone, stacked: the row that ended first must not
    cut the other's judging short."""
    want = stacked([_gen([[5, 2]]), _gen([[3, 4, 5, 6]])])
    got = _gen([[5, 2, 0, 0], [3, 4, 7, 6]])
    why, step = judge(want, got, TOL, EOS)[1:3]
    assert step == 3 and why.startswith("step 3, row 1: PyTorch picks token 5, the graph 7;")


def test_a_runner_that_stops_early_does_not_pass() -> None:
    want, got = _gen([[3, 4, 5]]), _gen([[3]])
    assert judge(want, got, TOL, EOS)[1:3] == ("step 2, row 0: the graph's runner stopped after 1 tokens", 2)


def test_nan_logits_do_not_pass() -> None:
    want, got = _gen([[3, 4]]), _gen([[3, 4]])
    got.logits[1][0, 0] = np.nan
    why, step = judge(want, got, TOL, EOS)[1:3]
    assert step == 2 and "both pick token 4, but logit 0: PyTorch 0, the graph nan" in why


def test_prompts_hold_no_special_token_and_a_batch_of_one_has_no_padded_layout(tmp_path: Path) -> None:
    spec = load_spec(TINY_ZOO / "llama_causal_lm.toml")
    prompts = generate_prompts(spec, 8, seed=0, special=frozenset({3, 4, 5}))
    assert set(prompts) == {"batch-1", "padded"}
    assert not {t for rows in prompts.values() for row in rows for t in row} & {0, 1, 2, 3, 4, 5}
    text = (TINY_ZOO / "llama_causal_lm.toml").read_text().replace("batch = { min = 1, max = 4 }\n", "")
    (tmp_path / "one.toml").write_text(text.replace('"batch"', "1"))  # one sequence, declared static
    assert set(generate_prompts(load_spec(tmp_path / "one.toml"), 8, seed=0)) == {"batch-1"}


def test_more_tokens_than_past_seq_holds_is_refused() -> None:
    spec = load_spec(TINY_ZOO / "llama_causal_lm.toml")  # past_seq up to 24
    assert generate_prompts(spec, 24, seed=0)["batch-1"]  # a prompt of 2, then past 2 + 24 - 2 = 24
    with pytest.raises(UsageError, match="--generate 25: a prompt of 2 tokens and 25 new ones need past_seq up to 25"):
        generate_prompts(spec, 25, seed=0)


def test_a_logits_room_widens_its_tolerance_and_no_other_logits() -> None:
    """int4's simulation holds how far its activations' near ties move each logit: a graph
    that settles a tie the other way is within it, a logit the tie does not reach is not."""
    room = [np.zeros((1, 8)), np.zeros((1, 8))]
    room[0][0, 1] = 1e-3
    want = Generation([[3, 4]], _logits([[3, 4]]), room)
    got = _gen([[3, 4]])
    got.logits[0][0, 1] += 8e-4
    assert judge(want, got, TOL, EOS)[1:3] == ("", None)
    got.logits[0][0, 2] += 8e-4
    why, step = judge(want, got, TOL, EOS)[1:3]
    assert step == 1 and "logit 2:" in why and "atol=1e-05" in why


def test_the_room_of_prompts_generated_alone_stacks_with_them() -> None:
    first = Generation([[5, 2]], _logits([[5, 2]]), [np.full((1, 8), 0.1)] * 2)
    second = Generation([[3, 4, 5]], _logits([[3, 4, 5]]), [np.full((1, 8), 0.2)] * 3)
    room = stacked([first, second]).room
    assert room is not None and [r[:, 0].tolist() for r in room] == [[0.1, 0.2], [0.1, 0.2], [0.0, 0.2]]
    assert stacked([first, _gen([[3]])]).room is None


def test_a_token_picked_on_a_near_tie_within_tolerance_parts_the_row_without_failing_it() -> None:
    """Two logits 1e-6 apart: a graph within tolerance may pick either; the row is said to part
    there and judged no further, the other row still is. Past the tolerance it is a divergence."""
    want = _gen([[3, 4, 5], [6, 6, 6]])
    want.logits[1][0, 7] = 1.0 - 1e-6
    got = _gen([[3, 7, 1], [6, 6, 6]])
    got.logits[1][0] = want.logits[1][0]
    got.logits[1][0, 7] = 1.0 + 1e-6
    got.logits[2][0] = np.arange(8.0)  # after the tie the row runs another text
    judged = judge(want, got, TOL, EOS)
    assert judged[1:3] == ("", None) and judged.agreed == 1  # one token as PyTorch's before it parted
    assert judged.parted == [
        "step 2, row 0: PyTorch picks token 4, the graph 7, on a near tie (PyTorch's logits 1 and 0.999999, "
        "the graph's 1 and 1, every logit within tolerance): the row is judged no further"
    ]
    got.logits[2][1, 6] = 0.5  # the other row is still judged
    assert judge(want, got, TOL, EOS)[1:3] == (
        "step 3, row 1: both pick token 6, but logit 6: PyTorch 1, the graph 0.5 (|diff| 0.5, atol=1e-05 rtol=0.0001)",
        3,
    )
    got.logits[1][0, 7] = 1.0 + 1e-3  # a pick the tolerance does not allow
    assert judge(want, got, TOL, EOS)[2] == 2


def test_another_token_that_is_no_near_tie_is_a_divergence_whatever_the_logits() -> None:
    """A runner that picks a token its own logits do not favour (a generator's search, not its
    argmax), or one PyTorch's logits put beyond the tolerance of its pick, diverges."""
    want = _gen([[3, 4]])
    got = _gen([[3, 5]])
    got.logits[1] = want.logits[1].copy()  # the graph's logits favour PyTorch's token 4
    why, step = judge(want, got, TOL, EOS)[1:3]
    assert step == 2 and why.startswith("step 2, row 0: PyTorch picks token 4, the graph 5;"), why
    got.logits[1][0, 5] = 1.0 + 1e-6  # favoured by the graph, but 1 below PyTorch's pick there
    assert judge(want, got, TOL, EOS)[2] == 2


def test_a_nudged_run_widens_the_room_of_every_logit_of_its_row_and_step() -> None:
    """The nudges flip other codes than a graph's rounding does: the room is twice the widest
    logit they move in the row, for each logit of it, and none where they move nothing."""
    made = Generation([[3, 4], [5, 6]], [np.zeros((2, 8)), np.zeros((2, 8))])
    tie = Generation([[3, 4], [5, 6]], [np.zeros((2, 8)), np.zeros((2, 8))])
    tie.logits[0][0, 1] = -1e-3
    room = _tie_room(made, [tie])
    assert np.array_equal(room[0][0], np.full(8, 2e-3)) and not room[0][1].any() and not room[1].any()


FULL_MASK_LM = """
module = "attn_export.zoo.hf_cache:CausalLMWithCache"
[[inputs]]
name = "input_ids"
dtype = "int64"
shape = ["batch", "seq"]
[[inputs]]
name = "attention_mask"
dtype = "int64"
shape = ["batch", "seq"]
mask = "full"
convention = "binary"
[[outputs]]
name = "logits"
shape = ["batch", "seq", 8]
[dims]
batch = { min = 1, max = 2 }
seq = { min = 1, max = 4 }
"""


def _gqa_graph(lengths: str) -> onnx.ModelProto:
    """A GroupQueryAttention whose ``seqlens_k`` is the mask's row ``sum`` less one, as
    genai's model builder computes it, its ``width`` less one for every row, or a ``constant``."""
    h = onnx.helper
    counted = {"sum": "ReduceSum", "width": "Shape", "constant": "Identity"}[lengths]
    made = h.make_node(counted, ["attention_mask", "one"] if lengths == "sum" else ["attention_mask"], ["sums"])
    nodes = [made, h.make_node("Sub", ["sums" if lengths != "constant" else "fixed", "one"], ["k"])]
    nodes.append(h.make_node("Cast", ["k"], ["seqlens_k"], to=onnx.TensorProto.INT32))
    inputs = ["q", "", "", "", "", "seqlens_k", "total"]
    nodes.append(
        h.make_node("GroupQueryAttention", inputs, ["out"], domain="com.microsoft", num_heads=1, kv_num_heads=1)
    )
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "seq"])],
        [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)],
        [
            h.make_tensor("one", onnx.TensorProto.INT64, [1], [1]),
            h.make_tensor("fixed", onnx.TensorProto.INT64, [1], [3]),
        ],
    )
    return h.make_model(graph)


def test_a_graph_from_elsewhere_that_reads_row_lengths_off_its_mask_is_padded_on_the_right(tmp_path: Path) -> None:
    """genai's model builder's graph carries no variant (``verify --spec``), yet its
    GroupQueryAttention reads each row's length off the mask: our loop pads its batch on the
    right, as genai's generator does. A graph whose lengths come from elsewhere takes no padding."""
    spec = load_spec(write_spec(tmp_path, "lm", FULL_MASK_LM))
    assert padding_side(spec, "fp32") is None
    assert padding_side(spec, "int4", lambda: _gqa_graph("sum")) == "right"
    assert padding_side(spec, "fp32", lambda: _gqa_graph("constant")) is None
    assert padding_side(spec, "fp32", lambda: _gqa_graph("width")) is None  # every row as long as the mask


def test_int4_computed_in_float_generates_with_its_weights_rounded_alone_and_float32s_own_room() -> None:
    """At accuracy level 0 a CPU computes MatMulNBits in float: the reference generation
    rounds the weights alone (no activation codes, so no nudge moves anything), and its room
    is how far the same generation in float64 is from it, 2 x per row and step."""
    from attn_export.checks.generate import torch_generate
    from attn_export.exporter.factory import instantiate

    spec = load_spec(TINY_ZOO / "llama_causal_lm.toml")
    module = instantiate(spec)
    prompts = generate_prompts(spec, 4, seed=0)["padded"]
    weights = torch_generate(module, spec, prompts, 4, 0, bits=4, activations=False)
    codes = torch_generate(module, spec, prompts, 4, 0, bits=4)
    assert weights.room is not None and codes.room is not None
    assert any(step.max() > 0 for step in weights.room)  # float32 against float64: never exactly 0
    assert max(step.max() for step in weights.room) < 1e-3  # float32's error, not int4's
    moved = max(float(np.abs(a - b).max()) for a, b in zip(weights.logits, codes.logits, strict=False))
    assert moved > 1e-4  # the activations' rounding is not in it
