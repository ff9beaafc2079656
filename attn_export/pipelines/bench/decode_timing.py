"""``bench --decode``: the cost of one decode step (one new token) against the cache's length.

For each model with a key/value cache (``model_spec.cache``), batch size and past length, PyTorch
eager (with its own cache) and ONNX Runtime (each built variant) run decode steps at
seq 1: per-token p50/p90, tokens/s, the ratio to eager, and peak memory per runner.
``bench --scenario S`` times the steps of a scenario preset (``model_spec.scenarios``) instead:
its batch, its first past, its steps as the window and its query tokens per step (more than
one for a prefill or a speculative step, where a row's latency is per step of that many).

How a step is measured:

* The cache is **prefilled with seeded random values** of shape ``[batch, kv_heads, past,
  head_dim]``, not by a prompt step: a step's cost depends on the cache's shape, not its
  values, and a prompt of ``past`` tokens would need ``seq`` up to 2048, which decoder
  specs do not declare (the zoo's allow 64).
* Each side decodes a window of ``window`` steps from that cache, feeding each step's
  presents back as the next step's pasts, then starts again from the prefilled cache; a
  row at past P times steps at past P .. P + window - 1 (fewer where the spec's range ends).
* ONNX Runtime runs with inputs and outputs bound (IOBinding): the prefilled cache, the
  token and every step's mask and positions are OrtValues made once; the presents ONNX
  Runtime allocates are bound as the next step's pasts as they are. Nothing crosses numpy
  between steps. What still copies: the graph's ``Concat`` writes past + new into a fresh
  present every step (an O(cache) copy inherent to separate past/present tensors; PyTorch's
  ``torch.cat`` does the same), and on CPU the presents are newly allocated from ONNX
  Runtime's arena each step.
* PyTorch and ONNX Runtime take turns in blocks (``runtimes.timing.measure_alternating``) with the
  same threads, and ONNX Runtime's idle threads do not spin, so neither steals the other's
  cores. A difference inside the noise decides nothing (``compare.latency.clearly_faster``).

Results are plain dataclasses; ``report/bench_text.py`` and ``report/plot.py`` render them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from attn_export.artifacts.manifest import Manifest
from attn_export.artifacts.provenance import versions
from attn_export.errors import InputError, UsageError
from attn_export.executors import SERIAL, Parallelism
from attn_export.model_spec import ModelSpec, load_spec
from attn_export.model_spec.cache import CacheSpec, cache_of
from attn_export.model_spec.inputs import draw_inputs
from attn_export.model_spec.memory import check_memory, memory_budget
from attn_export.model_spec.scenarios import SCENARIOS, scenario_sizes
from attn_export.model_spec.shapes import ShapePoint
from attn_export.pipelines.bench.cells import DecodeCell, decode_cell, time_cells
from attn_export.pipelines.bench.physics import copy_bandwidth
from attn_export.pipelines.bench.results import DecodeBenchOptions, DecodeBenchReport, DecodeRow
from attn_export.pipelines.bench.runners import graph_notes, peak_memory, timing_machine
from attn_export.pipelines.bench.unbuilt import Left, build_for_bench, left_out_notes, without_left_out
from attn_export.pipelines.building import BuildSummary
from attn_export.runtimes.base import check_feeds
from attn_export.runtimes.decoders import DecodeWindow
from attn_export.runtimes.timing import check_threads, physical_cores

__all__ = ["DEFAULT_PASTS", "bench_decode_models", "past_lengths", "plan_window", "run_decode_bench"]

#: Past lengths timed unless ``--past`` says otherwise, clamped to each spec's range.
DEFAULT_PASTS = (0, 128, 512, 2048)

Feeds = dict[str, np.ndarray]


def _cache(spec: ModelSpec) -> CacheSpec:
    cache = cache_of(spec)
    if cache is None:
        raise UsageError(
            f"{spec.name}: bench --decode needs a model with a key/value cache (inputs past_key_values.<i>.key/value, "
            "outputs present.<i>.key/value); it declares none"
        )
    return cache


def past_lengths(spec: ModelSpec, requested: Sequence[int] | None = None) -> list[int]:
    """The past lengths to time: ``requested`` (each within the spec's past range, else
    InputError), or ``DEFAULT_PASTS`` clamped to that range."""
    cache = _cache(spec)
    r = spec.dims[cache.past_dim]
    if requested is None:
        return sorted({min(max(p, r.min), r.max) for p in DEFAULT_PASTS})
    outside = [p for p in requested if not r.min <= p <= r.max]
    if outside:
        raise InputError(
            f"{spec.name}: past length {', '.join(map(str, outside))} is outside '{cache.past_dim}' "
            f"[{r.min}, {r.max}] (choose with --past)"
        )
    return list(dict.fromkeys(requested))


def _step_sizes(spec: ModelSpec, cache: CacheSpec, batch: int, past: int, seq: int = 1) -> dict[str, int]:
    """The sizes of one step of ``seq`` tokens at ``batch`` and ``past`` (a spec without a
    batch dim runs at batch 1 only: ``plan_window`` says so)."""
    batched = {"batch": batch} if "batch" in spec.dims else {}
    return spec.with_sums({name: 1 for name in spec.dims} | batched | {cache.seq_dim: seq, cache.past_dim: past})


def _deepest(spec: ModelSpec, cache: CacheSpec, past: int, seq: int, steps: int) -> int:
    """The past a window's last step reads, as ``plan_window`` plans it: its cache grows by
    ``seq`` a step until the spec's past range ends, or holds a sliding window's newest."""
    if cache.window is not None:  # its steps are not shortened: the window holds the newest
        return cache.kept(past + (steps - 1) * seq)
    return past + (max(1, min(steps, (spec.dims[cache.past_dim].max - past) // seq + 1)) - 1) * seq


def plan_window(spec: ModelSpec, batch: int, past: int, window: int, seed: int, seq: int = 1) -> DecodeWindow:
    """The feeds of ``window`` steps of ``seq`` tokens each (1: decode steps) from a cache of
    ``past`` random entries, shortened where the spec's past range ends; each step's feeds
    pass ``check_feeds``. A sliding-window cache (``[cache] window``) holds the newest
    ``min(past, window)`` of them, and its mask covers what it holds."""
    cache = _cache(spec)
    if "batch" not in spec.dims and batch != 1:
        raise InputError(
            f"{spec.name}: batch {batch} needs a dim named 'batch' (dims: {', '.join(spec.dims)}); "
            "without one the model runs at batch 1 only"
        )
    allowed = spec.dims[cache.seq_dim]
    if not allowed.min <= seq <= allowed.max:
        raise InputError(f"{spec.name}: a step of {cache.seq_dim} {seq} is outside [{allowed.min}, {allowed.max}]")
    if cache.window is None:
        window = max(1, min(window, (spec.dims[cache.past_dim].max - past) // seq + 1))
    rng = np.random.default_rng(seed)
    sizes = _step_sizes(spec, cache, batch, cache.kept(past), seq)
    past_names = {p for p, _ in cache.pairs}
    per_step = past_names | {cache.mask, cache.positions}
    pasts = draw_inputs(spec, sizes, rng, lambda name: name in past_names)
    fixed = draw_inputs(spec, sizes, rng, lambda name: name not in per_step)
    steps = []
    for k in range(window):
        first = past + k * seq  # this step's first token
        feeds = dict(fixed)
        for t in spec.inputs:
            if t.name == cache.mask and t.mask is not None:
                held = np.ones((batch, cache.kept(first) + seq), dtype=bool)
                feeds[t.name] = t.mask.convention.encode(held, t.dtype)
            elif t.name == cache.positions:
                feeds[t.name] = np.broadcast_to(np.arange(first, first + seq), (batch, seq)).astype(t.dtype)
        steps.append(feeds)
    window_plan = DecodeWindow(cache, past, pasts, steps, seq)
    inputs = {t.name: t for t in spec.inputs}
    for k in (0, window - 1):  # the first and the longest step: every size is in range
        shapes = {p: (*pasts[p].shape[:2], cache.kept(past + k * seq), pasts[p].shape[3]) for p in past_names}
        stand_in = {p: np.zeros(s, dtype=inputs[p].dtype) for p, s in shapes.items()}
        check_feeds(window_plan.feeds(k, stand_in), spec.inputs, spec.dims)
    return window_plan


def _rows(spec: ModelSpec, options: DecodeBenchOptions) -> tuple[list[tuple[int, int]], int, int]:
    """(batch, past) of every row to time, the tokens per step and the steps per window: the
    scenario's (``model_spec.scenarios``), else ``batches`` x ``pasts`` of one-token steps."""
    if options.scenario is None:
        return [(b, p) for b in options.batches for p in past_lengths(spec, options.pasts)], 1, options.window
    cache, scenario = _cache(spec), SCENARIOS[options.scenario]
    first = scenario_sizes(spec, options.scenario)[0]
    return [(first.get(cache.batch_dim or "", scenario.batch), first[cache.past_dim])], scenario.seq, scenario.steps


def run_decode_bench(
    out_dir: Path,
    manifest: Manifest,
    specs: Sequence[ModelSpec],
    options: DecodeBenchOptions,
    on_row: Callable[[DecodeRow], None] | None = None,
    parallelism: Parallelism = SERIAL,
    left: Left | None = None,
) -> DecodeBenchReport:
    """Time a decode step of every requested runner at every batch and past length (or the
    steps of ``options.scenario``), but the runners ``left`` out (said why,
    ``bench.unbuilt``); graphs come from ``out_dir``. Each model x batch x past
    is a cell (``cells.decode_cell``) on ``parallelism``'s executor, never beside another
    on one machine; rows come in model, batch, past order whichever ran them."""
    check_threads(options.threads)
    threads = options.threads or physical_cores()
    options = dataclasses.replace(options, threads=threads)
    report = DecodeBenchReport(
        machine=timing_machine(),
        versions=versions(),
        threads=threads,
        provider=options.provider,
        seed=options.seed,
        unavailable=left_out_notes(left or {}),
    )
    per_model = {spec.name: without_left_out(options, spec.name, left or {}) for spec in specs}
    for spec in specs:
        report.graph_notes.update(graph_notes(manifest, spec, per_model[spec.name]))
    bandwidth = copy_bandwidth()
    report.copy_gbps = bandwidth / 1e9
    plans = [(spec, _rows(spec, options)) for spec in specs]
    cells = [
        DecodeCell(
            out_dir,
            manifest,
            spec,
            per_model[spec.name],
            batch,
            past,
            seq,
            plan_window(spec, batch, past, window, options.seed, seq),
            bandwidth,
        )
        for spec, (points, seq, window) in plans
        for batch, past in points
    ]
    time_cells(report, parallelism, decode_cell, cells, on_row)
    for spec, (points, seq, _) in plans if options.memory else []:
        batch, past = max(b for b, _ in points), max(p for _, p in points)
        sizes = _step_sizes(spec, _cache(spec), batch, past, seq)
        report.memory_mb[spec.name] = peak_memory(out_dir, manifest, spec, per_model[spec.name], sizes)
    return report


def bench_decode_models(
    spec_paths: Sequence[Path],
    out_dir: Path,
    options: DecodeBenchOptions,
    on_row: Callable[[DecodeRow], None] | None = None,
    *,
    skip_without_cache: bool = False,
    parallelism: Parallelism = SERIAL,
) -> tuple[BuildSummary, DecodeBenchReport | None]:
    """Build the variants still missing from ``out_dir``, then time decode steps; no report
    when a graph failed to build. A model without a cache is a UsageError, or left out
    with ``skip_without_cache`` (the whole zoo); the past lengths are checked before
    anything is built."""
    check_threads(options.threads)
    parallelism.check_exclusive()
    specs = [load_spec(p) for p in spec_paths]
    if skip_without_cache:
        kept = [(p, s) for p, s in zip(spec_paths, specs, strict=True) if cache_of(s) is not None]
        if not kept:
            raise UsageError("bench --decode: none of these models has a key/value cache")
        spec_paths, specs = [p for p, _ in kept], [s for _, s in kept]
    for spec in specs:
        cache = _cache(spec)
        points, seq, steps = _rows(spec, options)
        deepest = [(b, p, _deepest(spec, cache, p, seq, steps)) for b, p in points]
        cases = [
            ShapePoint(f"the deepest step from batch {b}, past {p}", _step_sizes(spec, cache, b, deep, seq))
            for b, p, deep in deepest
        ]
        check_memory(spec, cases, memory_budget(options.max_memory, spec))
    built, ready = build_for_bench(spec_paths, out_dir, specs, options)
    if ready is None:
        return built, None
    manifest, left = ready
    return built, run_decode_bench(out_dir, manifest, specs, options, on_row, parallelism, left)
