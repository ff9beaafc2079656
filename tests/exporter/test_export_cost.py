"""What an export costs beside tracing: torch.onnx's table of ONNX functions is built once
per opset and process for our exports, and left as torch has it for anyone else's."""

from __future__ import annotations

import pytest

from attn_export.exporter.torch_export import _one_registry_per_opset

registration = pytest.importorskip("torch.onnx._internal.exporter._registration")


def test_our_exports_share_one_table_per_opset_and_leave_torch_as_it_was() -> None:
    registry = registration.ONNXRegistry
    original = registry.__dict__["from_torchlib"]
    with _one_registry_per_opset():
        first = registry.from_torchlib(opset_version=18)
        assert registry.from_torchlib(opset_version=18) is first
    with _one_registry_per_opset():
        assert registry.from_torchlib(opset_version=18) is first
    assert registry.__dict__["from_torchlib"] is original
