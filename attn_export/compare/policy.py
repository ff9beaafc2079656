"""The pass/fail policy, in one place: the element-wise tolerance rule, what makes an
output pass, and the latency gate.

Everything else measures (``numbers``, ``timing``) or renders (``report``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attn_export.spec import Tolerance
from attn_export.timing import LatencyStats

if TYPE_CHECKING:
    from attn_export.compare.numbers import OutputComparison

__all__ = ["allowed_error", "latency_gate", "output_passed"]


def allowed_error(tol: Tolerance, expected: np.ndarray) -> np.ndarray:
    """The pass rule's bound: |actual - expected| <= atol + rtol * |expected|."""
    return tol.atol + tol.rtol * np.abs(expected)


def output_passed(c: OutputComparison) -> bool:
    """Same shape and dtype, no NaN/Inf where PyTorch is finite, no NaN on both sides
    unless the spec allows it, every element within bounds."""
    nan_ok = c.shared_nan == 0 or c.allow_nan
    return c.shape_ok and c.dtype_ok and c.unexpected_nonfinite == 0 and nan_ok and c.mismatched == 0


def latency_gate(onnx: LatencyStats | None, torch: LatencyStats | None, max_slowdown: float | None) -> str | None:
    """Why ONNX Runtime is too slow against PyTorch under ``--max-slowdown``, or None."""
    if max_slowdown is None or onnx is None or torch is None or torch.p50_ms <= 0:
        return None
    ratio = onnx.p50_ms / torch.p50_ms
    if ratio <= max_slowdown:
        return None
    return (
        f"onnxruntime p50 {onnx.p50_ms:.3f} ms is {ratio:.2f}x PyTorch's "
        f"{torch.p50_ms:.3f} ms (--max-slowdown {max_slowdown:g})"
    )
