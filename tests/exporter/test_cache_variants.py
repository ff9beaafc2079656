"""Variants with a cache: the opset-23 Attention op with past inputs and ONNX Runtime's
MultiHeadAttention / GroupQueryAttention with past, built from the zoo decoders and verified
over decode steps; where ONNX Runtime cannot run a declared size, the build says so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from attn_export.cli import cli
from attn_export.errors import ExportFailure
from attn_export.exporter.cache_in_op import fold_cache
from attn_export.exporter.variants import make_variant
from tests.conftest import Built

#: The tests on the cache variants' build (3 decoders x 4 variants, 35-50 s) run in the slow
#: set, which CI runs; the rewrites on hand-made graphs below run in ``make test``.
BUILT = pytest.mark.slow


@pytest.fixture(scope="module")
def built(cache_build: Built) -> tuple[Path, Path, dict[str, str | None]]:
    return cache_build.out, cache_build.models, cache_build.errors


def _graph(out: Path, key: str) -> onnx.ModelProto:
    return onnx.load(out / f"{key}.onnx")


def _cache_op(proto: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    (node,) = [n for n in proto.graph.node if n.op_type == op_type]
    return node


@BUILT
def test_the_attention_op_takes_the_cache_in(built) -> None:
    out, _, errors = built
    for model in ("mha_kv_cache", "gqa_rope_kv_cache"):
        assert errors[f"{model}.attention-op"] is None
        proto = _graph(out, f"{model}.attention-op")
        node = _cache_op(proto, "Attention")
        assert list(node.input[4:]) == ["past_key_values.0.key", "past_key_values.0.value"]
        assert list(node.output[1:]) == ["present.0.key", "present.0.value"]
        pasts = {"past_key_values.0.key", "past_key_values.0.value"}
        assert not [n for n in proto.graph.node if n.op_type == "Concat" and pasts & set(n.input)]


@BUILT
def test_onnx_runtime_cache_ops_take_the_cache_in(built) -> None:
    out, _, errors = built
    for key, op_type, past in (
        ("mha_kv_cache.ort-past", "MultiHeadAttention", (6, 8)),
        ("gqa_one_stream.ort-past", "GroupQueryAttention", (3, 5)),
    ):
        assert errors[key] is None
        node = _cache_op(_graph(out, key), op_type)
        assert node.domain == "com.microsoft"
        assert list(node.input[past[0] : past[1]]) == ["past_key_values.0.key", "past_key_values.0.value"]
        assert list(node.output[1:]) == ["present.0.key", "present.0.value"]


@BUILT
def test_onnx_runtime_cache_ops_read_the_projections_with_no_layout_ops(built) -> None:
    """A step runs every node of the graph: heads a module only splits out of a projection
    (not the rotated query and key of the GQA model) reach the op as the projection, with no
    Reshape/Transpose pair each step, and nothing is left that nobody reads."""
    out, _, _ = built
    for key, op_type, projections in (
        ("mha_kv_cache.ort-past", "MultiHeadAttention", ["Add", "Add", "Add"]),
        ("gqa_one_stream.ort-past", "GroupQueryAttention", ["Reshape", "Reshape", "MatMul"]),
    ):
        proto = _graph(out, key)
        producers = {o: n for n in proto.graph.node for o in n.output}
        node = _cache_op(proto, op_type)
        assert [producers[name].op_type for name in node.input[:3]] == projections, key
        read = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
        assert not [n.name for n in proto.graph.node if not any(o in read for o in n.output)], key
        assert {c.name for c in proto.graph.initializer} <= read, key


@BUILT
def test_cache_variants_pass_verify_over_decode_steps(built, monkeypatch: pytest.MonkeyPatch) -> None:
    out, models, _ = built
    monkeypatch.chdir(models.parent)
    names = ["mha_kv_cache.attention-op", "gqa_rope_kv_cache.attention-op"]
    names += ["mha_kv_cache.ort-past", "gqa_one_stream.ort-past"]
    files = [str(out / f"{name}.onnx") for name in names]
    result = CliRunner().invoke(cli, ["verify", *files, "--no-latency", "--decode", "3"])
    assert result.exit_code == 0, result.output
    # both scenarios for each batched model, batch 1 for the one-stream one
    assert "7 of 7 decode trajectories agree (up to 3 steps after the prompt)" in result.output


@BUILT
def test_group_query_attention_where_onnx_runtime_refuses_a_declared_size(built) -> None:
    _, _, errors = built
    error = errors["gqa_rope_kv_cache.ort-past"]
    assert error is not None
    assert "smoke check at" in error and "batch_size must be 1 when sequence_length > 1 and past context" in error
    assert error.endswith(  # the plain export runs at the same feeds: the rewrite is named
        "; the export it was made from runs there, so the rewrite made the graph ONNX Runtime refuses (ort-past: "
        "a decoder's cache attention as ONNX Runtime's MultiHeadAttention or GroupQueryAttention with past inputs)"
    )


def _attention_graph(
    is_causal: int = 0,
    new_first: bool = False,
    mask: int | None = None,
    dtype: int = TensorProto.FLOAT,
    mask_shape: tuple[int | str, ...] = (1, 1, "s", "t"),
) -> onnx.ModelProto:
    """Attention over Concat(past, new) keys and values, as the opset-23 export writes it
    (the new keys computed in the graph); ``mask`` an input of that type and shape."""
    inputs = [helper.make_tensor_value_info(n, dtype, [1, 2, "s", 4]) for n in ("q", "k_in", "v")]
    inputs += [helper.make_tensor_value_info(n, dtype, [1, 2, "p", 4]) for n in ("past_k", "past_v")]
    if mask is not None:
        inputs.append(helper.make_tensor_value_info("mask", mask, list(mask_shape)))

    def cat(past: str, new: str, out: str) -> onnx.NodeProto:
        return helper.make_node("Concat", [new, past] if new_first else [past, new], [out], axis=2)

    nodes = [
        helper.make_node("Neg", ["k_in"], ["k"]),
        cat("past_k", "k", "present_k"),
        cat("past_v", "v", "present_v"),
        helper.make_node(
            "Attention", ["q", "present_k", "present_v", *(["mask"] if mask else [])], ["y"], is_causal=is_causal
        ),
    ]
    values = [helper.make_tensor_value_info("k", dtype, [1, 2, "s", 4])]
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y", "present_k", "present_v")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=values)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_only_a_cache_concat_in_past_new_order_without_is_causal_is_folded() -> None:
    for proto in (_attention_graph(is_causal=1), _attention_graph(new_first=True)):
        assert fold_cache(proto) == []  # causal: the op aligns its mask otherwise with past inputs
        assert [n.op_type for n in proto.graph.node] == ["Neg", "Concat", "Concat", "Attention"]
        with pytest.raises(ExportFailure, match="ort-past needs a decoder whose cache Concat"):
            make_variant("ort-past", proto)
    folded = fold_cache(_attention_graph())
    assert [list(op.node.input) for op in folded] == [["q", "k", "v", "", "past_k", "past_v"]]


def test_a_cache_kept_out_of_the_op_says_what_the_op_reads_instead() -> None:
    """Something the fold does not see through between the cache's Concat and the op (here
    an Identity): ort-past refuses naming it; attention-op builds and warns."""
    causal = _attention_graph(is_causal=1)
    causal.graph.node[-1].name = "sdpa"
    with pytest.raises(ExportFailure, match="here Attention node 'sdpa' has is_causal=1"):
        make_variant("ort-past", causal)
    proto = _attention_graph()
    proto.graph.node[1].name = "cat_k"
    attention = proto.graph.node[-1]
    attention.name = "sdpa"
    attention.input[1] = "repeated_k"
    repeat = helper.make_node("Identity", ["present_k"], ["repeated_k"], name="repeat_kv")
    proto.graph.node.insert(3, repeat)
    said = "the key of Attention node 'sdpa' comes from Identity node 'repeat_kv', not from the cache's Concat 'cat_k'"
    with pytest.raises(ExportFailure, match=f"here {said}"):
        make_variant("ort-past", proto)
    variant = make_variant("attention-op", proto)
    assert variant.info["cache_in_op"] == 0
    assert variant.warnings == [
        f"the cache stays outside the Attention op, concatenated every step as in the plain export: {said}: what "
        "lies between them stays outside the op (a repeat of the key/value heads folds only as an Unsqueeze, an "
        "Expand and a Reshape)"
    ]
    assert make_variant("attention-op", _attention_graph()).warnings == []  # folded: nothing to say


def _repeated_heads_graph(value_heads: int = 2) -> onnx.ModelProto:
    """Grouped-query attention as Hugging Face's sdpa layers export it: 4 query heads over a
    cache of 2 key/value heads (``value_heads`` for the values), each repeated to 4
    (``repeat_kv``: Unsqueeze at axis 2, Expand, Reshape) between the cache's Concat and the op."""
    proto = _attention_graph()
    graph = proto.graph
    graph.input[0].CopyFrom(helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 4, "s", 4]))
    graph.input[2].CopyFrom(helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, value_heads, "s", 4]))
    graph.input[4].CopyFrom(helper.make_tensor_value_info("past_v", TensorProto.FLOAT, [1, value_heads, "p", 4]))
    attention = graph.node[-1]
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([2], np.int64), "axis2"),
            numpy_helper.from_array(np.array([1, 4, -1, 4], np.int64), "merged"),
        ]
    )
    for kv, heads in (("k", 2), ("v", value_heads)):
        present, lifted, expanded, repeated = f"present_{kv}", f"{kv}_lifted", f"{kv}_expanded", f"{kv}_repeated"
        times = numpy_helper.from_array(np.array([1, 1, 4 // heads, 1, 1], np.int64), f"{kv}_times")
        graph.initializer.append(times)
        repeat = [
            helper.make_node("Unsqueeze", [present, "axis2"], [lifted]),
            helper.make_node("Expand", [lifted, times.name], [expanded]),
            helper.make_node("Reshape", [expanded, "merged"], [repeated]),
        ]
        for node in repeat:
            graph.node.insert(len(graph.node) - 1, node)
        attention.input[1 if kv == "k" else 2] = repeated
        graph.value_info.extend(
            helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
            for name, shape in (
                (present, [1, heads, "t", 4]),
                (lifted, [1, heads, 1, "t", 4]),
                (expanded, [1, heads, 4 // heads, "t", 4]),
                (repeated, [1, 4, "t", 4]),
            )
        )
    return proto


def test_a_repeat_of_the_cached_heads_is_folded_with_the_cache() -> None:
    """The Attention op groups 4 query heads over 2 key/value heads as repeat_kv does: the
    cache goes into the op with its own heads, the repeat (a copy of the whole cache each
    step) is gone, and the op gives what the repeat gave."""
    proto = _repeated_heads_graph()
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((1, 4, 3, 4)).astype(np.float32)}
    feeds |= {n: rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for n in ("k_in", "v")}
    feeds |= {n: rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for n in ("past_k", "past_v")}
    expected = _run(proto, feeds)
    folded = make_variant("attention-op", proto)
    assert folded.warnings == [] and folded.info["cache_in_op"] == 1
    assert [n.op_type for n in folded.proto.graph.node] == ["Neg", "Attention"]
    for got, want in zip(_run(folded.proto, feeds), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    unequal = _repeated_heads_graph()  # the key repeated, the value not: neither is folded
    attention = unequal.graph.node[-1]
    attention.input[2] = "present_v"
    assert fold_cache(unequal) == []
    assert fold_cache(_repeated_heads_graph(value_heads=1)) == []  # 2 key heads x 2, 1 value head x 4
    read = _repeated_heads_graph()  # the repeated keys also an output of the graph: they stay
    read.graph.output.append(helper.make_tensor_value_info("k_repeated", TensorProto.FLOAT, None))
    assert fold_cache(read) == []
    assert make_variant("attention-op", read).info["cache_in_op"] == 0  # and the variant builds, the repeat kept


@pytest.mark.parametrize(
    ("mask", "dtype", "rank"),
    [
        (TensorProto.BOOL, np.float32, 4),
        (TensorProto.FLOAT, np.float32, 4),
        (TensorProto.BOOL, np.float16, 4),
        (TensorProto.BOOL, np.float32, 2),  # [seq, total]
        (TensorProto.FLOAT, np.float32, 3),  # [heads or 1, seq, total]
    ],
)
def test_ort_past_gives_what_the_attention_op_gives_on_rows_without_a_key(mask: int, dtype: type, rank: int) -> None:
    shape = (1, 1, "s", "t")[4 - rank :]
    proto = _attention_graph(mask=mask, dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), mask_shape=shape)
    proto.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.int64), "ort_past_0/bsh_shape"))
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 3, 4)).astype(dtype) for n in ("q", "k_in", "v")}
    feeds |= {n: rng.standard_normal((1, 2, 2, 4)).astype(dtype) for n in ("past_k", "past_v")}
    seen = np.ones((1, 1, 3, 5)[4 - rank :], bool)
    seen[..., 0, :] = False  # the first query sees no key: the ONNX op gives 0 there
    seen[..., 1, 2] = False
    feeds["mask"] = seen if mask == TensorProto.BOOL else np.where(seen, 0, -np.inf).astype(dtype)
    expected = _run(proto, feeds)
    variant = make_variant("ort-past", proto)  # a name already in the graph is not reused
    assert "com.microsoft.MultiHeadAttention" in variant.info["ops"]
    got = _run(variant.proto, feeds)
    assert not np.any(expected[0][:, :, 0]) and not np.any(got[0][:, :, 0])
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize(
    ("split_shape", "perm", "merged"),
    [
        (["b", "s", 4, 8], [0, 2, 1, 3], True),  # heads split out of the projection: read it as it is
        (["s", "b", 4, 8], [0, 2, 1, 3], False),  # the lead axes swapped: not the projection's layout
        (["b", "s", 8, 4], [0, 2, 1, 3], True),  # any heads x head_dim of the same width splits alike
        (["b", "s", 4, 8], [0, 2, 3, 1], False),  # another transpose
        (["b", "s", 4, 4], [0, 2, 1, 3], False),  # a width that is not the projection's
        (["b", "s", 4, None], [0, 2, 1, 3], False),  # a size the graph does not declare
    ],
)
def test_only_a_pure_head_split_is_read_as_the_projection(split_shape: list, perm: list[int], merged: bool) -> None:
    from attn_export.exporter.variants.ort_past import _merged_heads

    nodes = [
        helper.make_node("Reshape", ["proj", "shape"], ["split"]),
        helper.make_node("Transpose", ["split"], ["heads"], perm=perm),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("proj", TensorProto.FLOAT, ["b", "s", 32])],
        [helper.make_tensor_value_info("heads", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([0, 0, 4, 8], np.int64), "shape")],
        value_info=[helper.make_tensor_value_info("split", TensorProto.FLOAT, split_shape)],
    )
    proto = helper.make_model(graph)
    producers = {o: n for n in proto.graph.node for o in n.output}
    assert _merged_heads(proto, "heads", producers) == ("proj" if merged else None)


def test_attention_op_gives_a_mask_one_row_per_query_where_onnx_runtime_needs_it() -> None:
    """ONNX broadcasts a ``[batch, 1, 1, keys]`` padding mask (``nn.MultiheadAttention``'s)
    over the queries; ONNX Runtime's kernel refuses it unless axis -2 is the query's length."""
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for n in ("q", "k_in", "v")}
    feeds |= {n: rng.standard_normal((1, 2, 2, 4)).astype(np.float32) for n in ("past_k", "past_v")}
    keep = np.array([[[[True, False, True, True, False]]]])
    padding = _attention_graph(mask=TensorProto.BOOL, mask_shape=(1, 1, 1, "t"))
    with pytest.raises(Exception, match="inconsistent q_sequence_length"):
        _run(padding, feeds | {"mask": keep})
    variant = make_variant("attention-op", padding)
    assert variant.info["mask_rows_expanded"] == 1
    rows = _attention_graph(mask=TensorProto.BOOL, mask_shape=(1, 1, "s", "t"))
    expected = _run(rows, feeds | {"mask": np.broadcast_to(keep, (1, 1, 3, 5))})
    for e, g in zip(expected, _run(variant.proto, feeds | {"mask": keep}), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6)
    assert make_variant("attention-op", rows).info["mask_rows_expanded"] == 0  # already one row per query
    second = helper.make_node("Attention", ["q", "present_k", "present_v", "mask"], ["y2"])  # a second reader
    padding.graph.node.append(second)
    padding.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, None))
    shared = make_variant("attention-op", padding)
    assert shared.info["mask_rows_expanded"] == 1 and shared.info["ops"]["Expand"] == 1
    attention = [n for n in shared.proto.graph.node if n.op_type == "Attention"]
    assert attention[0].input[3] == attention[1].input[3] != "mask"
    _run(shared.proto, feeds | {"mask": keep})
