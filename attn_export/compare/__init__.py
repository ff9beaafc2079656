"""Stage 5, the comparison: numbers measured per output (``numbers``), and the one policy
that judges them (``policy``)."""

from __future__ import annotations

from attn_export.compare.numbers import OutputComparison, compare_output, compare_outputs
from attn_export.compare.policy import latency_gate

__all__ = ["OutputComparison", "compare_output", "compare_outputs", "latency_gate"]
