"""The latency policy: when timings are too noisy to decide on, when one side is clearly
faster, and the ``--max-slowdown`` gate. Timings are measured in ``runtimes.timing``."""

from __future__ import annotations

from attn_export.runtimes.timing import LatencyStats

__all__ = ["MAX_SPREAD", "clearly_faster", "latency_gate", "noise"]

#: Timings whose p90 exceeds p50 by more than this factor are too noisy to decide on.
MAX_SPREAD = 1.5


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
