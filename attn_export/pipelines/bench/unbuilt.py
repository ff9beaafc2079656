"""Which runners a bench goes on without: an optional variant (``RunnerOptions.optional``)
that cannot be made for a model (onnxscript's fusions giving a graph ONNX Runtime refuses),
or whose graph a runtime asked for cannot load, is left out of that model's rows and said
why; any other failed build fails the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from attn_export.artifacts.manifest import Manifest, load_manifest
from attn_export.model_spec import ModelSpec
from attn_export.pipelines.bench.results import RunnerOptions
from attn_export.pipelines.bench.runners import unloadable
from attn_export.pipelines.building import BuildOptions, BuildSummary, build_models
from attn_export.runtimes import RUNTIMES

__all__ = ["Left", "build_for_bench", "left_out_notes", "unbuilt", "with_unloadable", "without_left_out"]

Options = TypeVar("Options", bound=RunnerOptions)
#: Model -> runner label -> why the model's rows go without it.
Left = dict[str, dict[str, str]]


def unbuilt(built: BuildSummary, options: RunnerOptions) -> Left | None:
    """The runners of the optional graphs that failed to build, with why; None when
    another graph failed."""
    failed = [r for r in built.results if not r.ok]
    if any(r.variant not in options.optional for r in failed):
        return None
    left: Left = {}
    for r in failed:
        model = r.name.removesuffix(f".{r.variant}")  # a result is named ``model.variant`` (``variant_key``)
        stage = r.failed_stage or "build"
        why = f"its graph could not be built: {r.error or f'its {stage} stage failed'}"
        for name in options.runtimes:
            left.setdefault(model, {})[RUNTIMES[name].runner_label(r.variant)] = why
    return left


def without_left_out(options: Options, model: str, left: Left) -> Options:
    """``options`` for ``model``'s rows: without its runners ``left`` out."""
    skipped = tuple(left.get(model, {}))
    return dataclasses.replace(options, skipped=skipped) if skipped else options


def with_unloadable(
    left: Left, out_dir: Path, manifest: Manifest, specs: Sequence[ModelSpec], options: RunnerOptions
) -> Left:
    """``left`` (``unbuilt``), and the optional graphs built that a runtime asked for cannot load."""
    for spec in specs:
        for label, why in unloadable(out_dir, manifest, spec, without_left_out(options, spec.name, left)).items():
            left.setdefault(spec.name, {})[label] = why
    return left


def left_out_notes(left: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The report's ``unavailable`` lines for the runners left out: ``model label`` -> why."""
    return {f"{model} {label}": why for model, labels in left.items() for label, why in labels.items()}


def build_for_bench(
    spec_paths: Sequence[Path], out_dir: Path, specs: Sequence[ModelSpec], options: RunnerOptions
) -> tuple[BuildSummary, tuple[Manifest, Left] | None]:
    """Build the variants still missing from ``out_dir``; then the folder's manifest and the
    runners left out, or None when a graph the run cannot go without failed to build."""
    variants = tuple(dict.fromkeys(options.variants))
    built = build_models(spec_paths, BuildOptions(out_dir, variants=variants, provider=options.provider))
    left = unbuilt(built, options)
    if left is None:
        return built, None
    manifest = load_manifest(out_dir)
    return built, (manifest, with_unloadable(left, out_dir, manifest, specs, options))
