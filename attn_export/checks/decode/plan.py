"""Plan decode trajectories: which layouts a spec allows, how many steps fit its ranges,
and what every step feeds (tokens, mask, positions) except the pasts, which each side brings
from its own presents; also the feeds of one pass without a cache over the same tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from attn_export.model_spec import ModelSpec, Rounding
from attn_export.model_spec.cache import CacheSpec
from attn_export.model_spec.inputs import draw_inputs
from attn_export.model_spec.model import concrete_shape
from attn_export.model_spec.shapes import example_sizes

__all__ = [
    "DEFAULT_STEPS",
    "LAYOUTS",
    "Feeds",
    "Trajectory",
    "alone_feeds",
    "axis_of",
    "empty_pasts",
    "layouts",
    "one_pass_feeds",
    "pass_length",
    "plan_trajectory",
    "step_count",
    "step_inputs",
]

#: Decode steps verify runs for a model with a cache unless ``--decode N`` says otherwise.
DEFAULT_STEPS = 8
#: How a trajectory's rows are padded (a trajectory's ``scenario``): ``full-batch`` is a batch
#: of rows of one length, for a graph that takes no padding (its mask ``full``).
LAYOUTS = ("batch-1", "left-padded", "full-batch")

Feeds = dict[str, np.ndarray]


@dataclass
class Trajectory:
    """What a scenario feeds at every step, except the pasts (each side brings its own)."""

    scenario: str
    #: The cache the steps feed back, and the dims that grow.
    cache: CacheSpec
    #: [batch, prompt + steps] True where a token is real (False: left padding).
    keep: np.ndarray
    prompt: int
    steps: list[Feeds]
    sizes: list[dict[str, int]]
    #: Every token input over the whole trajectory (None for a recorded one).
    tokens: Feeds | None = None
    #: Why the trajectory checks less than asked (fewer steps, recompute left out).
    notes: list[str] = field(default_factory=list)
    #: Per step, PyTorch's own float32 error per output: widens each tolerance as the
    #: sweep's floor does, so rounding is never reported as a divergence or a module bug.
    floors: list[dict[str, float]] = field(default_factory=list)
    #: Per step, what the int8 rounding does to the module's outputs (``Tolerance.int8_rounding``).
    int8: list[dict[str, Rounding]] = field(default_factory=list)

    @property
    def prompt_lengths(self) -> list[int]:
        return [int(k[: self.prompt].sum()) for k in self.keep]

    def span(self, k: int) -> tuple[int, int]:
        """The tokens of step ``k`` (from 0, the prompt): [start, stop) of the whole sequence."""
        return (0, self.prompt) if k == 0 else (self.prompt + k - 1, self.prompt + k)


def axis_of(spec: ModelSpec, name: str, dim: str | None) -> int | None:
    """The axis of ``dim`` in input or output ``name``, or None where it has none."""
    shape = next(t.shape for t in (*spec.inputs, *spec.outputs) if t.name == name)
    return shape.index(dim) if dim in shape else None


def layouts(spec: ModelSpec, cache: CacheSpec) -> list[str]:
    """The scenarios a spec's ranges allow: batch 1 where its batch may be 1, and where it
    may be 2 or more the padded batch (a mask that may pad says which tokens are padding) or,
    under a mask that takes no padding, a batch of rows of one length: rows a graph mixes
    up differ there and nowhere at batch 1."""
    batch = spec.dims.get(cache.batch_dim or "")
    out = ["batch-1"] if batch is None or batch.min <= 1 else []
    if batch is None or batch.max < 2 or not cache.mask:
        return out
    return out + ["left-padded" if cache.pads else "full-batch"]


def step_count(spec: ModelSpec, cache: CacheSpec, n_steps: int) -> tuple[int, list[str]]:
    """The decode steps that fit the spec's past range, and a note where that is fewer (a
    sliding-window cache never holds more than its window, which the range holds)."""
    if cache.window is not None:
        return n_steps, []
    prompt = _prompt_length(spec, cache)
    fits = spec.dims[cache.past_dim].max - prompt + 1
    if n_steps <= fits:
        return n_steps, []
    return fits, [
        f"{fits} of {n_steps} decode steps: a prompt of {prompt} and {cache.past_dim} max {fits + prompt - 1}"
    ]


def _prompt_length(spec: ModelSpec, cache: CacheSpec) -> int:
    return min(example_sizes(spec)[cache.seq_dim], spec.dims[cache.past_dim].max)


def _window(
    spec: ModelSpec, cache: CacheSpec, tokens: Feeds, keep: np.ndarray, start: int, stop: int, held: int | None = None
) -> Feeds:
    """Feeds (pasts excepted) for tokens [start, stop) of every row: the mask covers the
    ``held`` cached tokens before ``start`` (default: every one) and the new ones, positions
    are ``cumsum(mask) - 1`` over every token so far (0 on padding)."""
    positions = np.clip(np.cumsum(keep[:, :stop], axis=1) - 1, 0, None)[:, start:stop]
    first = start - (start if held is None else held)
    feeds: Feeds = {}
    for t in spec.inputs:
        if t.name == cache.mask and t.mask is not None:
            feeds[t.name] = t.mask.convention.encode(keep[:, first:stop].copy(), t.dtype)
        elif t.name == cache.positions:
            feeds[t.name] = positions.astype(t.dtype)
        elif t.name in tokens:
            axis = axis_of(spec, t.name, cache.seq_dim)
            value = tokens[t.name]
            feeds[t.name] = value if axis is None else np.take(value, range(start, stop), axis=axis)
    return feeds


def plan_trajectory(spec: ModelSpec, cache: CacheSpec, scenario: str, n_steps: int, seed: int) -> Trajectory:
    """The feeds of one scenario: a prompt step then up to ``n_steps`` steps of one token."""
    n_steps, notes = step_count(spec, cache, n_steps)
    prompt = _prompt_length(spec, cache)
    batch = 1 if scenario == "batch-1" else min(3, spec.dims[cache.batch_dim or ""].max)
    # Left-padded: rows of different prompt lengths, one all padding until its first
    # generated token.
    lengths = [prompt, 0, max(1, prompt // 2)][:batch] if scenario == "left-padded" else [prompt] * batch
    keep = np.ones((batch, prompt + n_steps), dtype=bool)
    for row, n in enumerate(lengths):
        keep[row, : prompt - n] = False
    base = example_sizes(spec) | ({cache.batch_dim: batch} if cache.batch_dim else {})
    fed_back = {past for past, _ in cache.pairs} | {cache.mask, cache.positions}
    every_token = spec.with_sums(base | {cache.seq_dim: keep.shape[1], cache.past_dim: 0})
    rng = np.random.default_rng(seed)
    tokens = draw_inputs(spec, every_token, rng, lambda name: name not in fed_back)
    windows = [(0, prompt)] + [(prompt + k - 1, prompt + k) for k in range(1, n_steps + 1)]
    steps = [_window(spec, cache, tokens, keep, a, b, cache.kept(a)) for a, b in windows]
    sizes = [spec.with_sums(base | {cache.seq_dim: b - a, cache.past_dim: cache.kept(a)}) for a, b in windows]
    seq_max = spec.dims[cache.seq_dim].max
    if prompt + n_steps - 1 > seq_max:
        notes.append(f"recompute checks steps up to {seq_max - prompt + 1}: {cache.seq_dim} max is {seq_max}")
    return Trajectory(scenario, cache, keep, prompt, steps, sizes, tokens, notes)


def empty_pasts(spec: ModelSpec, cache: CacheSpec, sizes: Mapping[str, int]) -> Feeds:
    """Every past at ``sizes`` (the prompt step's: an empty cache), zero-filled."""
    inputs = {t.name: t for t in spec.inputs}
    return {p: np.zeros(concrete_shape(inputs[p], sizes), dtype=inputs[p].dtype) for p, _ in cache.pairs}


def step_inputs(spec: ModelSpec, traj: Trajectory, outputs: list[Feeds]) -> list[Feeds]:
    """Each step's feeds with the pasts that ``outputs`` (one side's steps) fed back."""
    cache = traj.cache
    steps = []
    pasts = empty_pasts(spec, cache, traj.sizes[0])
    for feeds, out in zip(traj.steps, outputs, strict=True):
        steps.append({t.name: pasts[t.name] if t.name in pasts else feeds[t.name] for t in spec.inputs})
        pasts = {past: out[present] for past, present in cache.pairs}
    return steps


def alone_feeds(spec: ModelSpec, cache: CacheSpec, tokens: Feeds, keep: np.ndarray) -> Feeds:
    """The feeds of one call without a cache on ``tokens`` (every position)."""
    batch, length = keep.shape
    sizes = spec.with_sums(
        example_sizes(spec)
        | {cache.seq_dim: length, cache.past_dim: 0}
        | ({cache.batch_dim: batch} if cache.batch_dim else {})
    )
    return {**_window(spec, cache, tokens, keep, 0, length), **empty_pasts(spec, cache, sizes)}


def one_pass_feeds(spec: ModelSpec, traj: Trajectory, length: int) -> Feeds:
    """The feeds of one pass without a cache over the trajectory's first ``length`` tokens:
    what a step that ends there must agree with, row for row."""
    cache = traj.cache
    assert traj.tokens is not None, "a recorded trajectory has no tokens to recompute"
    tokens = {
        n: v if (a := axis_of(spec, n, cache.seq_dim)) is None else np.take(v, range(length), axis=a)
        for n, v in traj.tokens.items()
    }
    return alone_feeds(spec, cache, tokens, traj.keep[:, :length])


def pass_length(spec: ModelSpec, traj: Trajectory) -> int:
    """The tokens ``recompute`` takes in its one pass: as many as the seq range holds."""
    return min(traj.keep.shape[1], spec.dims[traj.cache.seq_dim].max)
