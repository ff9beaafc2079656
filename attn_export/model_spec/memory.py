"""Memory budgets: what one case needs at least, checked before anything is allocated.

Dims may reach ``MAX_DIM`` (2^20); at such sizes a single case needs more memory than any
machine has, and allocating it ends in a MemoryError or the OOM killer. The estimate is a
floor, so a refusal is certain: PyTorch and the runtime each hold the inputs and outputs,
and the attention scores of the largest query x key lengths exist at least once.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping

import numpy as np

from attn_export.errors import InputError, UsageError
from attn_export.model_spec.model import ModelSpec, TensorSpec, concrete_shape
from attn_export.model_spec.shapes import ShapePoint

__all__ = [
    "DEFAULT_SHARE",
    "ENV",
    "case_bytes",
    "check_memory",
    "format_bytes",
    "machine_memory",
    "memory_budget",
    "parse_bytes",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def parse_bytes(text: str, what: str) -> int:
    """``4GiB``, ``512M``, ``1.5 GB`` or a plain byte count; units are powers of 1024.
    ``what`` names where the text came from in the caller's words (``max_memory``)."""
    match = _SIZE.fullmatch(text.strip()) if text.isascii() else None
    value = float(match[1]) * _UNITS[match[2].upper()] if match else 0.0
    if not match or not 1 <= value < 1 << 62:
        raise UsageError(f"{what}: {text!r} is not a memory size like 8GiB, 512MiB or 1000000")
    return int(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


#: Where the person running a command may set the budget instead of ``--max-memory``.
ENV = "ATTN_EXPORT_MAX_MEMORY"
#: The share of this machine's physical memory a case may take when nobody sets a budget:
#: the rest is the runtimes' own (ONNX Runtime's arena, PyTorch's allocator) and the system's.
DEFAULT_SHARE = 0.5


def machine_memory() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(override: int | None = None, spec: ModelSpec | None = None) -> int:
    """The budget of the person running the command: ``override`` (``--max-memory``), else
    ``$ATTN_EXPORT_MAX_MEMORY``, else the spec's ``max_memory``, else half this machine's
    memory. Every reader calls it with the spec it judges by: a budget never comes from a
    build folder, data that may come from anywhere, so a spec read from a manifest
    (``ManifestEntry.model_spec``) carries none and only the checkout's can set one."""
    if override:
        return override
    if os.environ.get(ENV) is not None:
        return parse_bytes(os.environ[ENV], f"${ENV}")
    return (spec.max_memory if spec is not None else None) or int(DEFAULT_SHARE * machine_memory())


def _elements(t: TensorSpec, sizes: Mapping[str, int]) -> int:
    return math.prod(concrete_shape(t, sizes))


def case_bytes(spec: ModelSpec, sizes: Mapping[str, int]) -> int:
    """A floor on one case's memory: twice its inputs and outputs (PyTorch's and the
    runtime's) plus one float32 score matrix pairing every query row (all dims but the
    last of a float input) with every key position (the second-to-last dim of another, or
    the same, float input), for the largest such pair."""
    tensors = spec.inputs + spec.outputs
    io = sum(_elements(t, sizes) * np.dtype(t.dtype).itemsize for t in tensors)
    floats = [concrete_shape(t, sizes) for t in spec.inputs if t.dtype.startswith("float") and len(t.shape) >= 2]
    scores = max((math.prod(q[:-1]) * k[-2] for q in floats for k in floats), default=0)
    return 2 * io + 4 * scores


def check_memory(spec: ModelSpec, points: Iterable[ShapePoint], budget: int) -> None:
    """Refuse, before allocating anything, the first case whose floor exceeds ``budget``."""
    for point in points:
        need = case_bytes(spec, point.sizes)
        if need > budget:
            raise InputError(
                f"{spec.name}: case {point.label} ({point.describe()}) needs at least {format_bytes(need)}, over the "
                f"memory budget of {format_bytes(budget)}; narrow the dims or raise --max-memory (or "
                f"${ENV}, or max_memory in the spec)"
            )
