"""The source line a node is named by: the module's own code, never the adapter that calls
every module; a torch layer's node by torch's own line."""

from __future__ import annotations

import os

import torch

import attn_export.exporter.adapter as adapter
from attn_export.exporter.stack import innermost_line

TORCH = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
ADAPTER = adapter.__file__


def _stack(*frames: tuple[str, int, str]) -> str:
    return "".join(f'  File "{path}", line {line}, in f\n    {text}\n' for path, line, text in frames)


def test_a_modules_line_is_its_own_code() -> None:
    stack = _stack((ADAPTER, 97, "return self.module(x)"), ("/src/mine.py", 12, "y = q @ k"), (TORCH, 5, "op()"))
    assert innermost_line(stack) == ("/src/mine.py:12", "y = q @ k")


def test_a_torch_layers_line_is_torchs_not_the_adapters() -> None:
    stack = _stack((ADAPTER, 97, "return self.module(x)"), (TORCH, 6000, "attn = softmax(s)"))
    assert innermost_line(stack) == (f"{TORCH}:6000", "attn = softmax(s)")
    assert innermost_line(_stack((ADAPTER, 97, "return self.module(x)"))) == (f"{ADAPTER}:97", "return self.module(x)")
    assert innermost_line("") is None
