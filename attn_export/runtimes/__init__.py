"""Stage 4, the runtimes: PyTorch, ONNX Runtime (each provider) and the ONNX reference
evaluator, one interface.

Each answers ``run(feeds) -> dict[str, np.ndarray]`` with the same input checks.
``RUNTIMES`` is the registry of runtimes that run ONNX graphs: a new one is one new
module defining a ``RuntimeKind`` and one line here.
"""

from __future__ import annotations

from collections.abc import Sequence

from attn_export.errors import UsageError
from attn_export.runtimes import ort, reference
from attn_export.runtimes.base import Runtime, RuntimeKind, check_feeds
from attn_export.runtimes.target import PROVIDERS, Target

__all__ = ["PROVIDERS", "RUNTIMES", "Runtime", "RuntimeKind", "Target", "check_feeds", "resolve_targets"]

RUNTIMES: dict[str, RuntimeKind] = {
    ort.KIND.name: ort.KIND,
    reference.KIND.name: reference.KIND,
}


def resolve_targets(runtimes: Sequence[str], providers: Sequence[str]) -> list[Target]:
    """Targets for ``--runtime`` x ``--provider``; provider ``all`` means every installed one."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise UsageError(f"unknown runtime {', '.join(unknown)} (known: {', '.join(RUNTIMES)})")
    chosen = list(dict.fromkeys(providers))
    if "all" in chosen:
        chosen = [p for p in ort.available_providers() if p in PROVIDERS]
    bad = [p for p in chosen if p not in PROVIDERS]
    if bad:
        raise UsageError(f"unknown provider {', '.join(bad)} (known: {', '.join(PROVIDERS)})")
    targets = [t for name in dict.fromkeys(runtimes) for t in RUNTIMES[name].targets(chosen)]
    for t in targets:
        if t.provider is not None:
            ort.require_provider(t.provider)
    return targets
