"""The smallest failing case: delta debugging over a case's sizes and mask case.

From a failing case, each free dim is tried at its minimum, halfway there and one less,
and the mask case without the named case; a change is kept when the case still fails at
the same place (the same first region, or the same kind of failure where no region is
blamed), until no change is kept. Smaller cases are quicker to read, to replay and to file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from attn_export.model_spec import ModelSpec
from attn_export.pipelines.localize.results import LocalizeOptions, LocalizeReport

__all__ = ["shrink_case"]

#: Stop after this many localized cases; each costs a run per side and one per region.
MAX_TRIES = 60


def _same_failure(a: LocalizeReport, b: LocalizeReport) -> bool:
    if b.agrees:
        return False
    if a.first is None or b.first is None:
        return a.first is None and b.first is None
    return (a.first.fx_node, a.cause) == (b.first.fx_node, b.cause)


def _smaller(spec: ModelSpec, sizes: dict[str, int]) -> Iterator[dict[str, int]]:
    """Each free dim at its minimum, halfway to it and one less, largest step first."""
    for dim, r in spec.free_dims.items():
        now = sizes[dim]
        for size in dict.fromkeys((r.min, (now + r.min) // 2, now - 1)):
            if r.min <= size < now:
                yield {**sizes, dim: size}


def shrink_case(
    spec: ModelSpec,
    options: LocalizeOptions,
    failed: LocalizeReport,
    attempt: Callable[[LocalizeOptions], LocalizeReport],
) -> tuple[LocalizeOptions, LocalizeReport, int]:
    """The smallest case found that fails as ``failed`` does, its report and how many cases
    were localized on the way; ``options`` (a ``LocalizeOptions``) is ``failed``'s case."""
    best, report, tries = options, failed, 0
    changed = True
    while changed and tries < MAX_TRIES:
        changed = False
        sizes = {k: report.sizes[k] for k in spec.free_dims}
        trials = [dataclasses.replace(best, sizes=s) for s in _smaller(spec, sizes)]
        if best.mask_case:
            trials.insert(0, dataclasses.replace(best, mask_case=None))
        for trial in trials:
            if tries >= MAX_TRIES:
                break
            tries += 1
            found = attempt(trial)
            if _same_failure(failed, found):
                best, report, changed = trial, found, True
                break
    return best, report, tries
