"""The pass/fail policy, in one place: the element-wise tolerance rule, what makes an
output pass, and the latency gate.

Everything else measures (``numbers``, ``timing``) or renders (``report``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from attn_export.spec import Tolerance
from attn_export.timing import LatencyStats

if TYPE_CHECKING:
    from attn_export.compare.numbers import OutputComparison

__all__ = [
    "FLOOR_FACTOR",
    "MAX_SPREAD",
    "allowed_error",
    "case_tolerance",
    "clearly_faster",
    "latency_gate",
    "noise",
    "output_passed",
]

#: Timings whose p90 exceeds p50 by more than this factor are too noisy to decide on.
MAX_SPREAD = 1.5

#: A graph may differ from PyTorch by this many times PyTorch's own float32 error.
FLOOR_FACTOR = 10.0


def case_tolerance(tol: Tolerance, floor: float) -> Tolerance:
    """The output's tolerance on one case, widened by ``FLOOR_FACTOR`` x PyTorch's own
    float32 error there: large-magnitude inputs are judged by what float32 can do, and a
    graph wrong only for large values still fails (its error is far above the floor)."""
    return dataclasses.replace(tol, atol=tol.atol + FLOOR_FACTOR * floor)


def allowed_error(tol: Tolerance, expected: np.ndarray) -> np.ndarray:
    """The pass rule's bound: |actual - expected| <= atol + rtol * |expected|."""
    return tol.atol + tol.rtol * np.abs(expected)


def output_passed(c: OutputComparison) -> bool:
    """Same shape and dtype, no NaN/Inf where PyTorch is finite, no NaN on both sides
    unless the spec allows it, every element within bounds."""
    nan_ok = c.shared_nan == 0 or c.allow_nan
    return c.shape_ok and c.dtype_ok and c.unexpected_nonfinite == 0 and nan_ok and c.mismatched == 0


def noise(*stats: LatencyStats | None) -> str | None:
    """Why these timings are too noisy to decide on, or None: repeats that disagree
    (p90/p50 above ``MAX_SPREAD``) or a machine busier than its cores."""
    for s in stats:
        if s is None:
            continue
        if s.spread > MAX_SPREAD:
            return f"noisy (p90 is {s.spread:.1f}x p50), rerun"
        if s.load is not None and s.cores and s.load > s.cores:
            return f"noisy (load average {s.load:.1f} above {s.cores} cores), rerun"
    return None


def clearly_faster(a: LatencyStats, b: LatencyStats) -> bool:
    """``a`` beats ``b`` by more than the noise: even a's slow runs (p90) beat b's typical one."""
    return a.p90_ms < b.p50_ms


def latency_gate(onnx: LatencyStats | None, torch: LatencyStats | None, max_slowdown: float | None) -> str | None:
    """Why ONNX Runtime is too slow against PyTorch under ``--max-slowdown``, or None.

    Only a slowdown beyond the noise fails: ONNX Runtime's typical run (p50) must exceed R
    times even PyTorch's slow runs (p90). A slowdown inside the noise decides nothing;
    the report flags noisy timings instead."""
    if max_slowdown is None or onnx is None or torch is None or torch.p50_ms <= 0:
        return None
    ratio = onnx.p50_ms / torch.p50_ms
    if ratio <= max_slowdown or onnx.p50_ms <= max_slowdown * torch.p90_ms:
        return None
    return (
        f"onnxruntime p50 {onnx.p50_ms:.3f} ms is {ratio:.2f}x PyTorch's "
        f"{torch.p50_ms:.3f} ms (--max-slowdown {max_slowdown:g})"
    )
