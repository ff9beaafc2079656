"""The Python API: build and verify return the commands' result objects, export takes a
module in hand, assert_onnx_matches judges it by verify's sweep and rule. (The docs' API
example is run by tests/test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
import torch

import attn_export
from attn_export.errors import ExportFailure, SpecError, UsageError
from attn_export.pipelines.building import BuildResult, BuildSummary
from attn_export.pipelines.verify import VerifyReport
from tests.conftest import TINY_ZOO, Built, add_variant, key_scale_off, needs_transformers, tiny_spec
from tests.faulty_modules import ShapeBranchAttention
from tests.user_modules import LlamaStyleAttention

DIMS = {"batch": (1, 4), "seq": (1, 48)}


def test_build_and_verify_return_the_report_objects(tmp_path: Path) -> None:
    # torchscript, the fastest exporter: what is tested here is not the export
    spec = tiny_spec(tmp_path / "specs", exporter="torchscript")
    summary = attn_export.build(spec, out=tmp_path / "out")
    assert isinstance(summary, BuildSummary) and summary.counts["built"] == 1
    report = attn_export.verify(tmp_path / "out", models=tmp_path / "specs", seed=3)
    assert isinstance(report, VerifyReport) and report.passed and report.seed == 3
    assert all(c.onnx_latency is None for c in report.cases)  # numbers only, unless latency=True
    assert attn_export.build(tmp_path / "specs", out=tmp_path / "out").counts["skipped"] == 1  # a folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, BuildResult]:
    torch.manual_seed(0)
    module = LlamaStyleAttention()
    path = tmp_path_factory.mktemp("export") / "llama.onnx"
    return module, path, attn_export.export(module, inputs={"x": ["batch", "seq", 32]}, dims=DIMS, path=path)


def test_export_takes_a_module_in_hand_and_reads_its_outputs(exported) -> None:
    module, path, result = exported
    assert result.status == "built" and result.file == str(path) and all(result.stages.values())
    out = onnx.load(path).graph.output[0]
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", "seq", 32]


def test_assert_onnx_matches_passes_and_catches_another_module(exported) -> None:
    module, path, _ = exported
    attn_export.assert_onnx_matches(module, path, dims=DIMS)
    torch.manual_seed(1)
    with pytest.raises(AssertionError) as err:
        attn_export.assert_onnx_matches(LlamaStyleAttention(), path, dims=DIMS)
    lines = str(err.value).splitlines()
    assert lines[0] == "llama.onnx differs from LlamaStyleAttention in 13 of 13 cases:"
    assert re.match(
        r"  min \(batch=1,seq=1, seed 0\): output: 32/32 elements \(100.00%\) outside atol=1\.?\d*e-05", lines[1]
    )


def test_an_override_for_a_tensor_the_graph_lacks_is_refused(exported) -> None:
    """A graph that lost its mask input was judged against the module run without one, and
    passed; a misspelt name was dropped the same way."""
    module, path, _ = exported
    mask = {"mask": "padding", "convention": "ignore", "arg": "key_padding_mask"}
    with pytest.raises(UsageError, match=r"inputs=\{'key_padding_mask': \.\.\.\}: the graph has no input "):
        attn_export.assert_onnx_matches(module, path, dims=DIMS, inputs={"key_padding_mask": mask})
    with pytest.raises(UsageError, match=r"the graph has no output 'outptu' \(its outputs: output\)"):
        attn_export.assert_onnx_matches(module, path, dims=DIMS, outputs={"outptu": {"pick": 0}})


def test_export_raises_the_check_that_failed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ShapeBranchAttention(16, 2)
    dims = {"batch": (1, 4), "seq": (1, 24), "kv_seq": (1, 40)}
    inputs = {"query": ["batch", "seq", 16], "keys": ["batch", "kv_seq", 16], "values": ["batch", "kv_seq", 16]}
    with pytest.raises(ExportFailure, match=r"shape_branch_attention: the trace froze a value .*faulty_modules.py:\d+"):
        attn_export.export(module, inputs=inputs, dims=dims, path=tmp_path / "m.onnx", exporter="torchscript")
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(SpecError, match=r"'query' uses dim 'seq', which \[dims\] does not declare"):
        attn_export.export(module, inputs=inputs, dims={"batch": (1, 4)}, path=tmp_path / "m.onnx")


@pytest.mark.slow
def test_a_rotary_layer_in_hand_takes_its_rotary_module_from_its_own_config(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    layer = LlamaAttention(config, layer_idx=0)
    call = {"attention_mask": None, "position_embeddings": {"rotary": LlamaRotaryEmbedding, "positions_of": "x"}}
    dims = {"batch": (1, 3), "seq": (1, 24)}
    path = tmp_path / "llama.onnx"
    result = attn_export.export(layer, inputs={"x": ["batch", "seq", 32]}, dims=dims, path=path, call=call)
    assert result.status == "built" and [o.name for o in onnx.load(path).graph.output] == ["output"]
    attn_export.assert_onnx_matches(layer, path, dims=dims, call=call, outputs={"output": {"pick": 0}})
    rope = {"rope_type": "default", "rope_theta": 10.0}  # another rotary table: other numbers
    other = LlamaConfig(**{**config.to_dict(), "rope_parameters": rope})
    with pytest.raises(AssertionError, match="llama.onnx differs from LlamaAttention"):
        attn_export.assert_onnx_matches(
            layer, path, dims=dims, call=call, outputs={"output": {"pick": 0}}, config=other
        )


def test_ids_in_hand_are_drawn_over_their_tables_rows(tmp_path: Path) -> None:
    """As build learns them: drawn from 0..7, the 2-row token types failed the export and a
    graph clamping its ids at 7 passed."""
    from tests.conftest import clamp_input
    from tests.user_modules import TokenAttention

    torch.manual_seed(0)
    module, path = TokenAttention(), tmp_path / "tokens.onnx"
    ids = {"shape": ["batch", "seq"], "dtype": "int64"}
    dims = {"batch": (1, 3), "seq": (1, 16)}
    attn_export.export(module, inputs={"input_ids": ids, "token_type_ids": ids}, dims=dims, path=path)
    attn_export.assert_onnx_matches(module, path, dims=dims)
    onnx.save(clamp_input(path, "input_ids", 7), path)
    with pytest.raises(AssertionError, match="tokens.onnx differs from TokenAttention"):
        attn_export.assert_onnx_matches(module, path, dims=dims)


def test_inputs_the_module_cannot_take_are_one_error_naming_its_line(tmp_path: Path) -> None:
    """Before, torch's RuntimeError came out of the probe that reads the outputs' shapes."""
    dims = {"batch": (1, 2), "seq": (1, 8)}
    with pytest.raises(SpecError, match=r"\(x \[2, 3, 24\] float32\): RuntimeError: .* at tests/user_modules.py:\d+"):
        attn_export.export(
            LlamaStyleAttention(), inputs={"x": ["batch", "seq", 24]}, dims=dims, path=tmp_path / "x.onnx"
        )


@needs_transformers
def test_verify_regions_notes_or_fails_a_region_over_its_tolerance_where_the_outputs_agree(zoo_copy: Path) -> None:
    """BERT int8 with its key projection's scale x1.25 passes verify; ``regions`` says where
    (``verify --check-regions``, ``--strict-regions``), and nothing on the right graph."""
    name = add_variant(zoo_copy, "bert_attention", "int8")
    graph, point = zoo_copy / f"{name}.onnx", [{"batch": 2, "seq": 3}]
    right = attn_export.verify(graph, models=TINY_ZOO, shapes=point, regions="strict")
    assert right.passed and right.checks[0].notes == [], right.checks
    key_scale_off(zoo_copy, name, 1.25)
    assert attn_export.verify(graph, models=TINY_ZOO, shapes=point).checks[0].notes == []  # verify alone
    noted = attn_export.verify(graph, models=TINY_ZOO, shapes=point, regions="check")
    (note,) = noted.checks[0].notes
    assert noted.passed and noted.settings["regions"] == "check"
    assert note.startswith(f"{name}: outputs agree, but region linear_1 (") and "modeling_bert.py:" in note
    strict = attn_export.verify(graph, models=TINY_ZOO, shapes=point, regions="strict")
    assert not strict.passed and strict.checks[0].notes == []
    assert strict.checks[0].problems == [f"{note} --strict-regions"]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"regions": True}, 'regions: give "check", "strict" or None, not True'),
        ({"regions": "loud"}, "regions 'loud': give one of check, strict"),
        ({"regions": "check", "golden": True}, "regions compares with PyTorch: it cannot be combined with golden"),
    ],
)
def test_a_bad_regions_argument_is_a_usage_error_in_the_api_s_words(
    shared_tiny: Built, given: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError) as err:
        attn_export.verify(shared_tiny.out, models=shared_tiny.models, **given)  # type: ignore[arg-type]
    assert str(err.value) == message
