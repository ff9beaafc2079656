"""Stage: multi-step decoding of a model with a key/value cache (``spec.cache``).

A trajectory is a prompt step (an empty cache, the whole prompt) and then N steps of one
token. Each side, the expected one (PyTorch, or the golden recording) and the graph, feeds
its own ``present`` back as its ``past``, so an error that only shows once a cache holds
something grows step by step as it does in deployment. Two scenarios: batch 1, and a
left-padded batch with different prompt lengths (one row all padding during the prompt).
PyTorch is also checked against itself without a cache (every token so far in one step): a
cache that disagrees with recompute is a bug in the module, reported as such.

Steps are numbered from 1, the prompt; a causal mask aligned to the wrong end first shows
at step 2, when the cache is no longer empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attn_export.artifacts.golden import GoldenCase
from attn_export.compare import OutputComparison, compare_outputs
from attn_export.errors import AttnExportError, UsageError
from attn_export.runtimes.base import Runtime
from attn_export.runtimes.target import Target
from attn_export.spec import ModelSpec, Tolerance
from attn_export.spec.cache import CacheSpec, cache_of
from attn_export.spec.inputs import make_tensor
from attn_export.spec.masks import CONVENTIONS
from attn_export.spec.shapes import concrete_shape, example_sizes

__all__ = [
    "DEFAULT_STEPS",
    "SCENARIOS",
    "DecodeResult",
    "DecodeStep",
    "Trajectory",
    "compare_trajectories",
    "plan_trajectory",
    "record_trajectory",
    "recompute",
    "recorded_label",
    "run_trajectory",
    "split_recorded_label",
]

#: Decode steps verify runs for a model with a cache unless ``--decode N`` says otherwise.
DEFAULT_STEPS = 8
SCENARIOS = ("batch-1", "left-padded")
_LABEL = "decode"

Feeds = dict[str, np.ndarray]


@dataclass
class Trajectory:
    """What a scenario feeds at every step, except the pasts (each side brings its own)."""

    scenario: str
    #: [batch, prompt + steps] True where a token is real (False: left padding).
    keep: np.ndarray
    prompt: int
    steps: list[Feeds]
    sizes: list[dict[str, int]]

    @property
    def prompt_lengths(self) -> list[int]:
        return [int(k[: self.prompt].sum()) for k in self.keep]


def _prompt_length(spec: ModelSpec, cache: CacheSpec, n_steps: int) -> int:
    seq, past = spec.dims[cache.seq_dim], spec.dims[cache.past_dim]
    if past.min > 0:
        raise UsageError(f"{spec.name}: decoding starts from an empty cache; '{cache.past_dim}' needs min = 0")
    prompt = max(2, min(example_sizes(spec)[cache.seq_dim], seq.max - n_steps))
    if prompt > seq.max or prompt + n_steps - 1 > past.max:
        raise UsageError(
            f"{spec.name}: a prompt of {prompt} and {n_steps} decode steps need {cache.past_dim} up to "
            f"{prompt + n_steps - 1}; its range is [{past.min}, {past.max}] (pass a smaller --decode N)"
        )
    return prompt


def _batch_keep(spec: ModelSpec, scenario: str, prompt: int, n_steps: int) -> np.ndarray:
    """Real tokens per row: batch 1 has none padded; the left-padded batch has rows of
    different prompt lengths, one of them all padding until its first generated token."""
    batch_max = spec.dims["batch"].max if "batch" in spec.dims else 1
    lengths = [prompt] if scenario == "batch-1" else [prompt, 0, max(1, prompt // 2)][: min(3, batch_max)]
    keep = np.ones((len(lengths), prompt + n_steps), dtype=bool)
    for row, n in enumerate(lengths):
        keep[row, : prompt - n] = False
    return keep


def plan_trajectory(spec: ModelSpec, scenario: str, n_steps: int, seed: int) -> Trajectory:
    """The feeds of one scenario: a prompt step then ``n_steps`` steps of one token."""
    cache = cache_of(spec)
    assert cache is not None, "only models with a cache decode"
    prompt = _prompt_length(spec, cache, n_steps)
    keep = _batch_keep(spec, scenario, prompt, n_steps)
    batch, length = keep.shape
    if batch > 1 and "batch" not in spec.dims:
        raise UsageError(f"{spec.name}: decoding a batch needs a dim named 'batch'")
    base = example_sizes(spec) | ({"batch": batch} if "batch" in spec.dims else {})
    rng = np.random.default_rng(seed)
    fed_back = {past for past, _ in cache.pairs} | {cache.mask, cache.positions}
    # Token inputs for the whole trajectory at once, sliced per step along their seq axis.
    every_token = spec.with_sums(base | {cache.seq_dim: length, cache.past_dim: 0})
    whole = {t.name: make_tensor(t, every_token, rng) for t in spec.inputs if t.name not in fed_back}
    positions = np.clip(np.cumsum(keep, axis=1) - 1, 0, None)
    steps, sizes = [], []
    for k in range(n_steps + 1):
        past, seq = (0, prompt) if k == 0 else (prompt + k - 1, 1)
        step_sizes = spec.with_sums(base | {cache.seq_dim: seq, cache.past_dim: past})
        feeds: Feeds = {}
        for t in spec.inputs:
            if t.name == cache.mask:
                assert t.convention is not None
                feeds[t.name] = CONVENTIONS[t.convention].encode(keep[:, : past + seq].copy(), t.dtype)
            elif t.name == cache.positions:
                feeds[t.name] = positions[:, past : past + seq].astype(t.dtype)
            elif t.name in whole:
                axis = t.shape.index(cache.seq_dim) if cache.seq_dim in t.shape else None
                value = whole[t.name]
                feeds[t.name] = value if axis is None else np.take(value, range(past, past + seq), axis=axis)
        steps.append(feeds)
        sizes.append(step_sizes)
    return Trajectory(scenario, keep, prompt, steps, sizes)


def _empty_pasts(spec: ModelSpec, cache: CacheSpec, sizes: Mapping[str, int]) -> Feeds:
    inputs = {t.name: t for t in spec.inputs}
    return {p: np.zeros(concrete_shape(inputs[p], sizes), dtype=inputs[p].dtype) for p, _ in cache.pairs}


def run_trajectory(runtime: Runtime, spec: ModelSpec, traj: Trajectory) -> tuple[list[Feeds], str | None]:
    """Each step's outputs, the runtime feeding back its own presents; stops at the first
    step that cannot run, returning why."""
    cache = cache_of(spec)
    assert cache is not None
    results: list[Feeds] = []
    pasts = _empty_pasts(spec, cache, traj.sizes[0])
    for k, feeds in enumerate(traj.steps):
        ordered = {t.name: (pasts[t.name] if t.name in pasts else feeds[t.name]) for t in spec.inputs}
        try:
            outputs = runtime.run(ordered)
        except AttnExportError as e:
            return results, f"step {k + 1}: {e}"
        results.append(outputs)
        pasts = {past: outputs[present] for past, present in cache.pairs}
    return results, None


def recompute(runtime: Runtime, spec: ModelSpec, traj: Trajectory, step: int) -> Feeds | None:
    """PyTorch without a cache on every token up to ``step`` (1-based), or None where that
    many tokens exceed the declared seq range."""
    cache = cache_of(spec)
    assert cache is not None
    length = traj.prompt + step - 1
    if length > spec.dims[cache.seq_dim].max:
        return None
    feeds: Feeds = {}
    positions = np.clip(np.cumsum(traj.keep[:, :length], axis=1) - 1, 0, None)
    sizes = spec.with_sums(traj.sizes[0] | {cache.seq_dim: length, cache.past_dim: 0})
    pasts = _empty_pasts(spec, cache, sizes)
    for t in spec.inputs:
        if t.name in pasts:
            feeds[t.name] = pasts[t.name]
        elif t.name == cache.mask:
            assert t.convention is not None
            feeds[t.name] = CONVENTIONS[t.convention].encode(traj.keep[:, :length].copy(), t.dtype)
        elif t.name == cache.positions:
            feeds[t.name] = positions.astype(t.dtype)
        else:
            axis = t.shape.index(cache.seq_dim) if cache.seq_dim in t.shape else None
            parts = [s[t.name] for s in traj.steps[:step]]
            feeds[t.name] = parts[0] if axis is None else np.concatenate(parts, axis=axis)
    return runtime.run(feeds)


@dataclass
class DecodeStep:
    """One step of a trajectory: the graph against the expected side, and (PyTorch mode)
    the cached module against its own full recompute."""

    step: int
    past: int
    seq: int
    comparisons: list[OutputComparison] = field(default_factory=list)
    recompute: list[OutputComparison] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.comparisons)

    @property
    def consistent(self) -> bool:
        """Whether the module's cache agrees with recomputing every token."""
        return all(c.passed for c in self.recompute)

    @property
    def max_abs_error(self) -> float | None:
        numeric = [c.max_abs_error for c in self.comparisons if c.numeric]
        return max(numeric) if numeric and len(numeric) == len(self.comparisons) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "past": self.past,
            "seq": self.seq,
            "passed": self.passed,
            "consistent": self.consistent,
            "max_abs_error": self.max_abs_error,
            "error": self.error,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "recompute": [c.to_dict() for c in self.recompute],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecodeStep:
        return cls(
            d["step"],
            d["past"],
            d["seq"],
            [OutputComparison.from_dict(c) for c in d["comparisons"]],
            [OutputComparison.from_dict(c) for c in d["recompute"]],
            d.get("error"),
        )


@dataclass
class DecodeResult:
    """One model x target x scenario trajectory."""

    model: str
    target: Target
    scenario: str
    expected_from: str
    prompt_lengths: list[int]
    steps: list[DecodeStep] = field(default_factory=list)
    error: str | None = None

    @property
    def runtime(self) -> str:
        return self.target.label

    @property
    def first_divergence(self) -> DecodeStep | None:
        """The first step where the graph left the expected side."""
        return next((s for s in self.steps if not s.passed), None)

    @property
    def module_bug(self) -> DecodeStep | None:
        """The first step where the module's cache disagrees with its own recompute."""
        return next((s for s in self.steps if not s.consistent), None)

    @property
    def passed(self) -> bool:
        return self.error is None and self.first_divergence is None and self.module_bug is None

    def reasons(self) -> list[str]:
        out = [self.error] if self.error else []
        bug = self.module_bug
        if bug is not None:
            why = next(c.reason() for c in bug.recompute if not c.passed)
            out.append(
                f"module bug: with its cache the module disagrees with recomputing every token, from step "
                f"{bug.step} (past {bug.past}, seq {bug.seq}): {why}"
            )
        first = self.first_divergence
        if first is not None:
            why = first.error or next(c.reason() for c in first.comparisons if not c.passed)
            out.append(f"first divergence at step {first.step} (past {first.past}, seq {first.seq}): {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        first, bug = self.first_divergence, self.module_bug
        return {
            "model": self.model,
            "runtime": self.runtime,
            "target": self.target.to_dict(),
            "scenario": self.scenario,
            "expected_from": self.expected_from,
            "prompt_lengths": self.prompt_lengths,
            "passed": self.passed,
            "error": self.error,
            "first_divergence": first.step if first else None,
            "module_bug_from_step": bug.step if bug else None,
            "steps": [s.to_dict() for s in self.steps],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecodeResult:
        return cls(
            d["model"],
            Target(**d["target"]),
            d["scenario"],
            d["expected_from"],
            list(d["prompt_lengths"]),
            [DecodeStep.from_dict(s) for s in d["steps"]],
            d.get("error"),
        )


def _padded_rows(spec: ModelSpec, cache: CacheSpec, query_keep: np.ndarray) -> dict[str, np.ndarray]:
    """Per output with [batch, ..., seq, ...] axes: True at the rows of padded queries."""
    presents = {present for _, present in cache.pairs}
    out = {}
    for t in spec.outputs:
        if t.name in presents or cache.seq_dim not in t.shape or t.shape[0] != "batch":
            continue
        axis = t.shape.index(cache.seq_dim)
        shape = [1] * len(t.shape)
        shape[0], shape[axis] = query_keep.shape
        out[t.name] = ~query_keep.reshape(shape)
    return out


def _compare(
    expected: Feeds, actual: Feeds, tolerances: Mapping[str, Tolerance], blank: Mapping[str, np.ndarray]
) -> list[OutputComparison]:
    """compare_outputs, with the rows in ``blank`` set to 0 on both sides (not compared)."""

    def cleared(values: Feeds) -> Feeds:
        out = dict(values)
        for name, rows in blank.items():
            if name in out and out[name].ndim == rows.ndim:
                out[name] = np.where(np.broadcast_to(rows, out[name].shape), 0, out[name]).astype(out[name].dtype)
        return out

    return compare_outputs(cleared(expected), cleared(actual), tolerances)


def compare_trajectories(
    spec: ModelSpec,
    traj: Trajectory,
    expected: list[Feeds],
    actual: list[Feeds],
    tolerances: Mapping[str, Tolerance],
    actual_error: str | None,
    recomputed: list[Feeds | None] | None = None,
) -> list[DecodeStep]:
    """Per step: the graph's outputs and presents against the expected side's (padded
    query rows left out under ``fully_masked = "ignore"``), and the expected side's
    against recompute (real tokens only: a padded query has nothing to agree on)."""
    cache = cache_of(spec)
    assert cache is not None
    steps = []
    for k, sizes in enumerate(traj.sizes[: len(expected)]):
        past, seq = sizes[cache.past_dim], sizes[cache.seq_dim]
        query_keep = traj.keep[:, past : past + seq]
        padded = _padded_rows(spec, cache, query_keep)
        step = DecodeStep(k + 1, past, seq)
        if k < len(actual):
            step.comparisons = _compare(
                expected[k], actual[k], tolerances, padded if spec.fully_masked == "ignore" else {}
            )
        else:
            step.error = actual_error or "the graph produced no output"
        full = recomputed[k] if recomputed and k < len(recomputed) else None
        if full is not None:
            mine = {n: v for n, v in full.items() if n not in padded}
            for name in padded:
                axis = spec.outputs[[t.name for t in spec.outputs].index(name)].shape.index(cache.seq_dim)
                mine[name] = np.take(full[name], range(past, past + seq), axis=axis)
            step.recompute = _compare(mine, expected[k], tolerances, padded)
        steps.append(step)
        if step.error:
            break
    return steps


def record_trajectory(spec: ModelSpec, traj: Trajectory, outputs: list[Feeds]) -> list[GoldenCase]:
    """The steps as golden cases: each step's feeds with the pasts PyTorch fed itself, and
    its outputs (``verify --golden`` replays them, feeding the graph its own pasts)."""
    cache = cache_of(spec)
    assert cache is not None
    cases = []
    pasts = _empty_pasts(spec, cache, traj.sizes[0])
    for k, (feeds, out) in enumerate(zip(traj.steps, outputs, strict=True)):
        inputs = {t.name: pasts[t.name] if t.name in pasts else feeds[t.name] for t in spec.inputs}
        cases.append(GoldenCase(recorded_label(traj.scenario, k + 1), traj.sizes[k], inputs, out, {}))
        pasts = {past: out[present] for past, present in cache.pairs}
    return cases


def recorded_label(scenario: str, step: int) -> str:
    """A golden case label for one recorded step: ``decode-<scenario>-<step>``."""
    return f"{_LABEL}-{scenario}-{step}"


def split_recorded_label(label: str) -> tuple[str, int] | None:
    """(scenario, step) of a recorded decode step's label, else None."""
    head, _, step = label.rpartition("-")
    prefix, _, scenario = head.partition("-")
    if prefix != _LABEL or scenario not in SCENARIOS or not step.isdigit():
        return None
    return scenario, int(step)
