"""What the benchmark scripts share: a figure measured in several whole runs, printed as its
median with the lowest and highest in brackets (a ratio whose bracket holds 1.00 decides
nothing), and which variants a float32 target may pick."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["float32_exact", "spread"]


def spread(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """``median [lowest–highest]``, each formatted with ``fmt`` and followed by ``unit``."""
    return f"{statistics.median(values):{fmt}}{unit} [{min(values):{fmt}}–{max(values):{fmt}}]"


def float32_exact(variant: str) -> bool:
    """No link of the variant's chain computes below float32 (int8, fp16 do)."""
    from attn_export.spec import variant_chain

    return not any("float32" in link.takes for link in variant_chain(variant).links)
