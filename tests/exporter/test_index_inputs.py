"""Token ids are drawn over every row of the embedding they index (read from the module
by build, or declared as ``values``), not from a few small values: a graph that clamps or
truncates its table differs only at the rows those never reach."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import SpecError
from attn_export.exporter.factory import instantiate
from attn_export.exporter.index_inputs import lookup_ranges
from attn_export.model_spec import load_spec, spec_from_dict
from attn_export.model_spec.inputs import make_feeds
from tests.conftest import clamp_input, plant, write_spec

TOKENS = """
module = "tests.user_modules:TokenAttention"
[[inputs]]
name = "input_ids"
dtype = "int64"
shape = ["batch", "seq"]
{values}
[[inputs]]
name = "token_type_ids"
dtype = "int64"
shape = ["batch", "seq"]
[[outputs]]
name = "output"
shape = ["batch", "seq", 16]
[dims]
batch = { min = 1, max = 3 }
seq = { min = 1, max = 16 }
"""


def _spec(folder: Path, values: str = "") -> Path:
    return write_spec(folder, "tokens", TOKENS.replace("{values}", values))


def test_each_id_input_is_drawn_over_the_rows_of_its_embedding(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path))
    vocab = lookup_ranges(instantiate(spec), spec)
    assert vocab == {"input_ids": (0, 49), "token_type_ids": (0, 1)}
    feeds = [make_feeds(dataclasses.replace(spec, vocab=vocab), {"batch": 3, "seq": 16}, s) for s in range(3)]
    assert max(f["input_ids"].max() for f in feeds) > 40  # 0..7 before: a table cut at 8 rows passed
    assert {int(v) for f in feeds for v in f["token_type_ids"].flat} == {0, 1}  # 0..7 failed: 2 rows


def test_declared_values_are_drawn_and_never_replaced(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, "values = { min = 3, max = 5 }"))
    assert lookup_ranges(instantiate(spec), spec) == {"token_type_ids": (0, 1)}
    drawn = make_feeds(spec, {"batch": 3, "seq": 16}, 0)["input_ids"]
    assert set(drawn.flat) == {3, 4, 5}
    assert spec.to_dict()["inputs"][0]["values"] == {"min": 3, "max": 5}


@pytest.mark.slow  # a build and two verifies (10 s)
def test_a_graph_that_clamps_its_ids_fails_verify(tmp_path: Path) -> None:
    models, out = tmp_path / "models", tmp_path / "out"
    _spec(models)
    built = CliRunner().invoke(cli, ["build", "--models", str(models), "--out", str(out)])
    assert built.exit_code == 0, built.output
    assert json.loads((out / "manifest.json").read_text())["models"]["tokens"]["spec"]["vocab"] == {
        "input_ids": [0, 49],
        "token_type_ids": [0, 1],
    }
    verify = ["verify", str(out), "--models", str(models), "--no-latency"]
    assert CliRunner().invoke(cli, verify).exit_code == 0
    plant(out, "tokens", clamp_input(out / "tokens.onnx", "input_ids", 7))
    result = CliRunner().invoke(cli, verify)
    assert result.exit_code == 1, result.output
    assert "FAIL tokens" in result.output and "output:" in result.output
    # the manifest is data: narrowed to the rows the clamp keeps, it once passed the graph
    doc = json.loads((out / "manifest.json").read_text())
    doc["models"]["tokens"]["spec"]["vocab"] = {"input_ids": [0, 7], "token_type_ids": [0, 1]}
    (out / "manifest.json").write_text(json.dumps(doc))
    narrowed = CliRunner().invoke(cli, verify)
    assert narrowed.exit_code == 1 and "FAIL tokens" in narrowed.output, narrowed.output


def test_the_rows_travel_with_the_built_spec_and_only_there(tmp_path: Path) -> None:
    """The manifest's copy keeps them, outside the content hash; a spec file declares
    ``values`` instead, on an integer input only."""
    spec = load_spec(_spec(tmp_path))
    built = dataclasses.replace(spec, vocab={"input_ids": (2, 49)})
    assert spec_from_dict(built.to_dict()).vocab == {"input_ids": (2, 49)}
    assert spec_from_dict(built.to_dict() | {"vocab": {"input_ids": 50}}).vocab == {
        "input_ids": (0, 49)
    }  # older builds
    assert built.content_hash() == spec.content_hash()
    path = _spec(tmp_path)
    path.write_text("vocab = { input_ids = 50 }\n" + path.read_text())
    with pytest.raises(SpecError, match="unknown key 'vocab'"):
        load_spec(path)
    for vocab in ({"output": 3}, {"input_ids": [0, 2**70]}, {"input_ids": [5, 4]}):  # a manifest is data
        with pytest.raises(SpecError, match="'vocab' must map integer inputs"):
            spec_from_dict(built.to_dict() | {"vocab": vocab})
    path.write_text(
        TOKENS.replace("{values}", "").replace('name = "output"', 'name = "output"\nvalues = { min = 0, max = 1 }')
    )
    with pytest.raises(SpecError, match="unknown key 'values' in outputs"):
        load_spec(path)
    for values, said in [
        ("values = { min = 5, max = 4 }", "values 5..4 is empty or outside int64"),
        ("values = [0, 4]", r"values must be a table like \{ min = 0, max = 999 \}"),
    ]:
        with pytest.raises(SpecError, match=said):
            load_spec(_spec(tmp_path, values))


class _Exits(torch.nn.Module):
    """Looks its ids up, then exits: the build's own first run reports it, not this probe."""

    def __init__(self) -> None:
        super().__init__()
        self.words = torch.nn.Embedding(50, 16)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        self.words(input_ids)
        raise SystemExit(0)


def test_a_module_that_exits_leaves_the_probe_with_nothing_learnt(tmp_path: Path) -> None:
    assert lookup_ranges(_Exits(), load_spec(_spec(tmp_path))) == {}


class _Shifted(torch.nn.Module):
    """Ids shifted before their lookup (OPT reads its position table at positions + 2), a
    cast id indexing a buffer and ``index_select`` on a smaller one; ids taken from a
    number and a sum of ids, which are no shifts."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(40, 16)
        self.register_buffer("cos", torch.randn(30, 16), persistent=False)
        self.register_buffer("sin", torch.randn(20, 16), persistent=False)
        self.register_buffer("last", torch.tensor(39), persistent=False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.positions(input_ids + 2)
        x = x + self.cos[token_type_ids.to(torch.int32) - 1 + 1]
        x = x + torch.index_select(self.sin, 0, token_type_ids.flatten().clone()).view(x.shape)
        x = x + self.positions(self.last - input_ids)  # no shift: the ids' zeros arrive as 39
        return x + self.positions(token_type_ids + token_type_ids)


def test_ids_land_on_rows_after_a_cast_or_a_shift_by_a_constant(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path))
    assert lookup_ranges(_Shifted(), spec) == {"input_ids": (0, 37), "token_type_ids": (0, 19)}
    feeds = make_feeds(dataclasses.replace(spec, vocab=lookup_ranges(_Shifted(), spec)), {"batch": 3, "seq": 16}, 0)
    _Shifted()(*(torch.from_numpy(feeds[k]) for k in ("input_ids", "token_type_ids")))  # every id lands on a row


class _Sized(torch.nn.Module):
    """Lookups that change with the sizes: a table sliced to the sequence, and ids shifted
    by its length."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(40, 16)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.positions.weight[: input_ids.shape[1]][token_type_ids]
        return x + self.positions(input_ids + input_ids.shape[1])


def test_a_lookup_that_changes_with_the_sizes_sets_no_range(tmp_path: Path) -> None:
    """Measured at the example sizes alone, they fixed ranges PyTorch itself fails outside of
    at other sizes (the sequence's rows 0..2; ids 0..36 with a shift of 3)."""
    assert lookup_ranges(_Sized(), load_spec(_spec(tmp_path))) == {}
