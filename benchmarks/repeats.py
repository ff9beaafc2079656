"""What the benchmark scripts share: a figure measured in several whole runs, printed as its
median with the lowest and highest in brackets (a ratio whose bracket holds 1.00 decides
nothing), calls timed in rounds of alternating blocks, and which variants a float32 target
may pick."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

__all__ = ["float32_exact", "repeated", "spread"]


def spread(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """``median [lowest–highest]``, each formatted with ``fmt`` and followed by ``unit``."""
    return f"{statistics.median(values):{fmt}}{unit} [{min(values):{fmt}}–{max(values):{fmt}}]"


def float32_exact(variant: str) -> bool:
    """No link of the variant's chain computes below float32 (int8, fp16 do)."""
    from attn_export.spec import variant_chain

    return not any("float32" in link.takes for link in variant_chain(variant).links)


def repeated(calls: dict[str, Callable[[], object]], repeats: int, budget_s: float) -> dict[str, list[float]]:
    """Each call's p50 (ms) in each of ``repeats`` rounds of alternating blocks."""
    from attn_export.runtimes.timing import measure_alternating

    p50s: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, stats in measure_alternating(calls, budget_s=budget_s).items():
            p50s[label].append(stats.p50_ms)
    return p50s
