"""What an export costs beside tracing: torch.onnx's table of ONNX functions is built once
per opset and process for our exports (again when what it is made from changes), and left
as torch has it for anyone else's."""

from __future__ import annotations

import pytest

from attn_export.exporter import torch_export

registration = pytest.importorskip("torch.onnx._internal.exporter._registration")


def test_our_exports_share_one_table_per_opset_and_leave_torch_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = registration.ONNXRegistry
    original = registry.__dict__["from_torchlib"]
    with torch_export._one_registry_per_opset():
        first = registry.from_torchlib(opset_version=18)
        assert registry.from_torchlib(opset_version=18) is first
    with torch_export._one_registry_per_opset():
        assert registry.from_torchlib(opset_version=18) is first
    assert registry.__dict__["from_torchlib"] is original
    # a module that registers functions of its own gets a table that holds them
    monkeypatch.setattr(torch_export, "_table_sources", lambda: ("one more function",))
    with torch_export._one_registry_per_opset():
        assert registry.from_torchlib(opset_version=18) is not first
    assert registry.__dict__["from_torchlib"] is original
