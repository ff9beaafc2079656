"""The source line a node is named by: the module's own code, never the adapter that calls
every module; a torch layer's node by torch's own line."""

from __future__ import annotations

import os
from typing import Any

import torch

import attn_export.exporter.adapter as adapter
from attn_export.exporter.stack import innermost_line, root_cause

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


def _module_code_that_fails() -> None:
    try:
        {}["missing"]
    except KeyError:  # the module handles this one; raising the next, it becomes its context
        raise ValueError("the real failure")  # noqa: B904


#: An exporter that wraps what the module raises, and the caller that catches it, in a file
#: outside the module's code (as torch's and this package's exporter are).
_EXPORTER = compile(
    "def export(call):\n"
    "    try:\n"
    "        try:\n"
    "            call()\n"
    "        except ValueError as e:\n"
    "            raise RuntimeError('Failed to export the model') from e\n"
    "    except RuntimeError as e:\n"
    "        return e\n",
    "/site-packages/exporter/wrap.py",
    "exec",
)
CODE = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _export_error() -> BaseException:
    scope: dict[str, Any] = {}
    exec(_EXPORTER, scope)  # noqa: S102 - our own constant
    return scope["export"](_module_code_that_fails)  # type: ignore[no-any-return]


def test_the_root_cause_is_the_error_the_wrapper_hides_at_the_modules_line() -> None:
    cause, at = root_cause(_export_error(), CODE)
    assert type(cause) is ValueError and str(cause) == "the real failure"  # not the KeyError it handled
    assert at.endswith('`raise ValueError("the real failure")  # noqa: B904`'), at


def test_frames_outside_the_modules_code_name_no_line() -> None:
    cause, at = root_cause(_export_error(), ("/nowhere/",))
    assert type(cause) is ValueError and at == ""  # the innermost cause, past the handled one
