"""Which graphs a bench goes on without: an optional variant (``RunnerOptions.optional``)
that cannot be made for a model, as when onnxscript's fusions give a graph ONNX Runtime
refuses, is left out of that model's rows and said why; any other failed build fails the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

from attn_export.pipelines.bench.results import RunnerOptions
from attn_export.pipelines.build import BuildSummary
from attn_export.runtimes import RUNTIMES

__all__ = ["unbuilt", "unbuilt_notes", "without_unbuilt"]

Options = TypeVar("Options", bound=RunnerOptions)
#: (model, variant) -> why its graph could not be built.
Unbuilt = Mapping[tuple[str, str], str]


def unbuilt(built: BuildSummary, options: RunnerOptions) -> dict[tuple[str, str], str] | None:
    """The optional graphs that failed to build, with why; None when another graph failed."""
    failed = [r for r in built.results if not r.ok]
    if any(r.variant not in options.optional for r in failed):
        return None
    # a result is named by its manifest key, ``spec.variants.variant_key``: ``model.variant``
    return {
        (r.name.removesuffix(f".{r.variant}"), r.variant): r.error or f"its {r.failed_stage or 'build'} stage failed"
        for r in failed
    }


def without_unbuilt(options: Options, model: str, left: Unbuilt) -> Options:
    """``options`` for ``model``'s rows: the variants that were built for it."""
    kept = [v for v in options.variants if (model, v) not in left]
    return options if len(kept) == len(options.variants) else dataclasses.replace(options, variants=kept)


def unbuilt_notes(left: Unbuilt, options: RunnerOptions) -> dict[str, str]:
    """Each runner a left-out graph would have had, per model, and why it has none."""
    return {
        f"{model} {RUNTIMES[name].runner_label(variant)}": f"its graph could not be built: {why}"
        for (model, variant), why in left.items()
        for name in options.runtimes
    }
