"""The comparison stage: each output measured against the expected one, with the one pass
rule (``outputs``), the latency policy: noise and the slowdown gate (``latency``), and the
placement policy (``placement``)."""

from __future__ import annotations

from attn_export.compare.latency import latency_gate
from attn_export.compare.outputs import OutputComparison, compare_output, compare_outputs
from attn_export.compare.placement import placement_gate

__all__ = ["OutputComparison", "compare_output", "compare_outputs", "latency_gate", "placement_gate"]
