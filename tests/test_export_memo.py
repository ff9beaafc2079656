"""The test session's memo of exports (``tests/export_memo.py``) gives a second export of the
same module, spec and feeds as the first one made it, and exports anew wherever any of them
differs: a memo that answered for another module would let a planted fault pass unexported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attn_export.exporter import torch_export
from attn_export.exporter.factory import instantiate
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes
from tests import export_memo
from tests.conftest import TINY_MHA, tiny_spec


def _made(path: Path) -> tuple[object, object, dict[str, object]]:
    spec = load_spec(path)
    return instantiate(spec), spec, make_feeds(spec, example_sizes(spec), 0)


def test_the_key_holds_the_weights_the_spec_and_the_feeds(tmp_path: Path) -> None:
    module, spec, feeds = _made(tiny_spec(tmp_path))
    key = export_memo._key(module, spec, feeds, 18, "dynamo")
    again, _, _ = _made(tiny_spec(tmp_path / "again"))
    assert key is not None and export_memo._key(again, spec, feeds, 18, "dynamo") == key
    with torch.no_grad():
        next(again.parameters())[0, 0] += 1e-3  # type: ignore[attr-defined]
    assert export_memo._key(again, spec, feeds, 18, "dynamo") != key
    assert export_memo._key(module, spec, feeds, 23, "dynamo") != key
    moved = {name: value + 1 for name, value in feeds.items()}  # type: ignore[operator]
    assert export_memo._key(module, spec, moved, 18, "dynamo") != key
    other = load_spec(tiny_spec(tmp_path / "other", body=TINY_MHA.replace("max = 24", "max = 20")))
    assert export_memo._key(module, other, feeds, 18, "dynamo") != key
    module.scale = lambda x: x  # type: ignore[attr-defined]  # nothing names it: not keyed, exported each time
    assert export_memo._key(module, spec, feeds, 18, "dynamo") is None


def test_a_second_export_is_a_copy_of_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, spec, feeds = _made(tiny_spec(tmp_path))
    first = torch_export._export(module, spec, feeds, 18, "dynamo")
    first.proto.graph.node.pop()  # a caller's edit reaches no later export
    monkeypatch.setattr(torch_export, "_dynamo", lambda *a: pytest.fail("exported a second time"))
    second = torch_export._export(module, spec, feeds, 18, "dynamo")
    assert len(second.proto.graph.node) == len(first.proto.graph.node) + 1
    assert second.program is first.program


@pytest.mark.fresh_export
def test_a_test_marked_fresh_export_exports_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, spec, feeds = _made(tiny_spec(tmp_path))
    torch_export._export(module, spec, feeds, 18, "dynamo")
    monkeypatch.setattr(torch_export, "_dynamo", lambda *a: pytest.fail("exported a second time"))
    with pytest.raises(pytest.fail.Exception, match="exported a second time"):
        torch_export._export(module, spec, feeds, 18, "dynamo")


def test_a_method_patched_on_the_class_is_a_new_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, spec, feeds = _made(tiny_spec(tmp_path))
    key = export_memo._key(module, spec, feeds, 18, "dynamo")
    monkeypatch.setattr(type(module), "forward", lambda self, q, k, v: q)
    assert export_memo._key(module, spec, feeds, 18, "dynamo") != key


def test_tied_weights_are_another_key_than_equal_untied_ones(tmp_path: Path) -> None:
    module, spec, feeds = _made(tiny_spec(tmp_path))
    key = export_memo._key(module, spec, feeds, 18, "dynamo")
    with torch.no_grad():
        module.k_linear.weight.copy_(module.q_linear.weight)  # type: ignore[attr-defined]
    untied = export_memo._key(module, spec, feeds, 18, "dynamo")
    module.k_linear.weight = module.q_linear.weight  # type: ignore[attr-defined]
    assert len({key, untied, export_memo._key(module, spec, feeds, 18, "dynamo")}) == 3
