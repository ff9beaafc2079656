"""The source line an exported op came from, read from the stack trace torch.export keeps
on each FX node (``node.meta["stack_trace"]``) and the dynamo exporter copies onto each ONNX
node (``pkg.torch.onnx.stack_trace``): the innermost frame outside torch, so that a Linear's
op points at the line that called the layer, not at torch's own ``F.linear`` call."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attn_export.model_spec import ModelSpec

__all__ = ["import_path", "innermost_line", "module_code", "root_cause"]

#: ``File "...", line N, in f`` and the line's text, as torch writes a stack.
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)')
#: This package's exporter (its adapter calls every module): never the module's line.
_EXPORTER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.cache
def _package_dir(name: str) -> str | None:
    """A package's folder, found without importing it."""
    found = importlib.util.find_spec(name)
    return os.path.dirname(os.path.abspath(found.origin)) if found and found.origin else None


def _torch_dir() -> str | None:
    return _package_dir("torch")


def module_code(spec: ModelSpec) -> tuple[str, ...]:
    """The folders a spec's module code lies in: the spec's folder, and the top-level
    package of its module (``transformers`` for a Hugging Face layer) and of its config's
    class (``transformers`` for a whole decoder the zoo's adapter wraps: its code is what
    branches)."""
    names = (spec.module, (spec.config or {}).get("class", ""))
    tops = [name.partition(":")[0].split(".")[0] for name in names if name]
    folders = [spec.search_path, *(_package_dir(top) for top in dict.fromkeys(tops))]
    return tuple(os.path.abspath(d) + os.sep for d in folders if d)


def root_cause(error: BaseException, code: tuple[str, ...], *roots: str) -> tuple[BaseException, str]:
    """The error an exporter's wrappers hide ("Failed to export ..." says nothing of why),
    and `` at file:line `code` `` of the innermost frame in the module's ``code`` folders
    it passed through ("" where none did). Wrappers are followed by their explicit cause
    first, then by the error they were raised while handling; without the module's line,
    the innermost explicit cause: an error the module caught and handled is not the cause."""
    caused = _chain(error, lambda e: e.__cause__)
    for err in caused + _chain(error, lambda e: e.__cause__ or (None if e.__suppress_context__ else e.__context__)):
        at = _module_line(err, code, roots)
        if at:
            return err, at
    return caused[-1], ""


def _chain(error: BaseException, inner: Callable[[BaseException], BaseException | None]) -> list[BaseException]:
    chain = [error]
    while (nxt := inner(chain[-1])) is not None and all(nxt is not e for e in chain):
        chain.append(nxt)
    return chain


def _module_line(error: BaseException, code: tuple[str, ...], roots: tuple[str, ...]) -> str:
    """`` at file:line `code` `` of the innermost frame of ``error``'s traceback in ``code``."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if os.path.abspath(f.filename).startswith(code) and not os.path.abspath(f.filename).startswith(_EXPORTER_DIR)
    ]
    if not frames:
        return ""
    at = f" at {import_path(frames[-1].filename, *roots)}:{frames[-1].lineno}"
    return at + (f" `{frames[-1].line.strip()}`" if frames[-1].line else "")


def innermost_line(stack: str) -> tuple[str, str] | None:
    """``("file:line", text)`` of the innermost frame of ``stack`` outside torch and this
    package's exporter (whose adapter calls every module); the innermost of all where no
    frame is outside them (a torch layer: its own line, not the adapter's call of it); None
    when it has none."""
    frames = _FRAME.findall(stack or "")
    if not frames:
        return None
    torch_dir = _torch_dir()
    layers = [f for f in frames if not os.path.abspath(f[0]).startswith(_EXPORTER_DIR)]
    outside = [f for f in layers if not (torch_dir and os.path.abspath(f[0]).startswith(torch_dir + os.sep))]
    path, line, text = (outside or layers or frames)[-1]
    return f"{path}:{line}", text.strip()


def import_path(filename: str, *roots: str) -> str:
    """``filename`` as its module is imported (relative to the longest of ``roots`` and the
    ``sys.path`` entries holding it: ``transformers/modeling_utils.py``), so that a record
    names no machine's folders; unchanged when none holds it."""
    path = os.path.abspath(filename)
    package = os.path.dirname(path)
    while os.path.isfile(os.path.join(package, "__init__.py")):  # an editable install is on no sys.path entry
        package = os.path.dirname(package)
    roots = tuple(os.path.abspath(p or os.curdir) for p in (*roots, *sys.path, package))
    holding = [r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(holding, key=len)) if holding else filename
