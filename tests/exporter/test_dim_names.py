"""A declared dim has one name, the spec's, on every graph input and output: a deploy config
reads the graph's names, so build names the cache's sum dim ``total_seq``, never ``past_seq +
seq``, and a graph that names a dim otherwise fails naming both. A graph exported by hand
may keep the exporter's sum of the parts' names for the sum dim: it is the same axis."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest

from attn_export.errors import GraphCheckError
from attn_export.exporter.graph_checks import check_dynamic_axes, graph_shapes, name_dims
from attn_export.model_spec import ModelSpec, load_spec
from tests.conftest import TINY_ZOO, needs_transformers

DECODERS = ["mha_kv_cache", pytest.param("llama_sdpa_kv_cache", marks=needs_transformers)]


@pytest.fixture(scope="module", params=DECODERS)
def decoder(request: pytest.FixtureRequest, zoo_dir: Path) -> tuple[ModelSpec, Path]:
    """A decoder of the tiny zoo as build wrote it: its spec and its graph."""
    return load_spec(TINY_ZOO / f"{request.param}.toml"), zoo_dir / f"{request.param}.onnx"


def test_every_graph_names_each_dim_as_its_spec_does(decoder: tuple[ModelSpec, Path]) -> None:
    spec, path = decoder
    shapes = graph_shapes(onnx.load(path))
    for t in (*spec.inputs, *spec.outputs):
        assert list(shapes[t.name]) == list(t.shape), t.name
    assert {shapes[t.name][2] for t in spec.outputs if t.name.startswith("present.")} == {"total_seq"}


def _renamed(proto: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for value in (*copy.graph.input, *copy.graph.output, *copy.graph.value_info):
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param == old:
                d.dim_param = new
    return copy


def _presents_named(proto: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``proto`` with the outputs' total_seq axes (the presents') named ``name``, in place."""
    for value in proto.graph.output:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param == "total_seq":
                d.dim_param = name
    return proto


@pytest.mark.parametrize(("old", "new"), [("seq", "s0"), ("batch", "s1")])
def test_a_graph_dim_named_otherwise_fails_naming_both(decoder: tuple[ModelSpec, Path], old: str, new: str) -> None:
    spec, path = decoder
    proto = _renamed(onnx.load(path), old, new)
    message = f"is named '{new}' in the graph, but the spec names that dim '{old}'"
    with pytest.raises(GraphCheckError, match=re.escape(message)):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)
    name_dims(proto, spec.inputs, spec.outputs, spec.dims)  # what the exporter does: the spec's names again
    check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)


def test_the_exporters_sum_of_the_parts_names_the_sum_dim(decoder: tuple[ModelSpec, Path]) -> None:
    """torch.onnx.export names a present's axis ``past_seq + seq`` while the mask's is
    ``total_seq``: every case agreed, and verify --spec failed the graph on that name alone."""
    spec, path = decoder
    proto = _presents_named(onnx.load(path), "past_seq + seq")
    check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)
    check_dynamic_axes(_renamed(proto, "total_seq", "seq + past_seq"), spec.name, spec.inputs, spec.outputs, spec.dims)
    mask = next(t.name for t in spec.inputs if "total_seq" in t.shape)
    with pytest.raises(GraphCheckError, match=rf"'total_seq' is 'total_seq' on input '{mask}' \(axis 1\) and"):
        check_dynamic_axes(_renamed(proto, "past_seq + seq", "t"), spec.name, spec.inputs, spec.outputs, spec.dims)


def test_a_sum_of_the_wrong_dims_is_never_renamed_into_a_right_one(decoder: tuple[ModelSpec, Path]) -> None:
    spec, path = decoder
    proto = _renamed(onnx.load(path), "total_seq", "past_seq + past_seq")
    name_dims(proto, spec.inputs, spec.outputs, spec.dims)
    with pytest.raises(GraphCheckError, match="declares total_seq = past_seq \\+ seq"):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)


def test_a_cache_that_keeps_a_window_the_spec_does_not_declare_is_told_to_declare_it(
    decoder: tuple[ModelSpec, Path],
) -> None:
    """Before, the message was the graph's expression alone (Max(0, past_seq + seq - ...))."""
    spec, path = decoder
    proto = _presents_named(onnx.load(path), "Min(7, past_seq + seq)")
    with pytest.raises(
        GraphCheckError, match=re.escape("keeps the newest 7 positions, a sliding window; declare [cache] window = 7")
    ):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)
    proto = _renamed(onnx.load(path), "total_seq", "past_seq + past_seq")
    with pytest.raises(GraphCheckError, match=r"declares total_seq = past_seq \+ seq$"):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs, spec.dims)
