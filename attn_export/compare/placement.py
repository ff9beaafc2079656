"""The placement policy: when nodes that ran off the asked execution provider fail a case
(``--require-placement``). Placement is read in ``runtimes.placement``."""

from __future__ import annotations

from attn_export.runtimes.placement import Placement, describe_counts

__all__ = ["placement_gate"]


def placement_gate(placement: Placement, required: bool) -> str | None:
    """Why the graph did not run where it was asked to, under ``--require-placement``, or
    None. Fallbacks fail, naming their ops and counts; shape and index arithmetic that
    ONNX Runtime keeps on the CPU on purpose never does. A placement that could not be
    read fails too: a required check that did not run proves nothing."""
    if not required:
        return None
    if placement.error:
        return f"placement: could not be read ({placement.error}) (--no-require-placement to skip)"
    if not placement.fallbacks:
        return None
    n = sum(c.count for c in placement.fallbacks)
    return (
        f"placement: {n} of {placement.nodes} nodes ran off {placement.provider}: "
        f"{describe_counts(placement.fallbacks)} (--no-require-placement to allow)"
    )
