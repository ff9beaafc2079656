"""Stage: multi-step decoding of a model with a key/value cache (``spec.cache``).

A trajectory is a prompt step (an empty cache, the whole prompt) and then N steps of one
token. Each side, the expected one (PyTorch, or the golden recording) and the graph, feeds
its own ``present`` back as its ``past``, so an error that only shows once a cache holds
something grows step by step as it does in deployment. Two padding layouts (the code's
``scenario``, not to be confused with ``spec.scenarios``' presets): batch 1, and a
left-padded batch with different prompt lengths (one row all padding during the prompt).
PyTorch is also checked against itself without a cache (every token so far in one step): a
cache that disagrees with recompute is a bug in the module, reported as such. At every step
each present must hold what its past and the new tokens make, on both sides
(``checks.cache_growth``). A sliding-window cache (``[cache] window = N``) is fed back as it
is kept: a step's past is the newest ``min(tokens so far, N)`` positions and its mask covers
those and the new tokens; the recompute and the padded rows alone compare the positions both
sides still hold.

Steps are numbered from 1, the prompt; a causal mask aligned to the wrong end first shows
at step 2, when the cache is no longer empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from attn_export.checks.cache_growth import CacheCarry, CacheGrowth, cache_carry, cache_growth
from attn_export.compare import OutputComparison, compare_outputs
from attn_export.errors import AttnExportError, GraphCheckError
from attn_export.runtimes.base import Runtime
from attn_export.runtimes.target import Target
from attn_export.spec import ModelSpec, Rounding, Tolerance
from attn_export.spec.cache import CacheSpec
from attn_export.spec.inputs import draw_inputs
from attn_export.spec.model import concrete_shape
from attn_export.spec.shapes import example_sizes
from attn_export.spec.tolerance import rounding_key

if TYPE_CHECKING:
    from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = [
    "DEFAULT_STEPS",
    "LAYOUTS",
    "DecodeResult",
    "DecodeStep",
    "Trajectory",
    "compare_trajectories",
    "one_pass_feeds",
    "pass_length",
    "plan_trajectory",
    "pytorch_trajectories",
    "layouts",
    "step_count",
    "unpadded",
    "recompute",
    "run_trajectory",
]

#: Decode steps verify runs for a model with a cache unless ``--decode N`` says otherwise.
DEFAULT_STEPS = 8
#: How a trajectory's rows are padded (a trajectory's ``scenario``).
LAYOUTS = ("batch-1", "left-padded")

Feeds = dict[str, np.ndarray]
#: How a cache's outputs are named (``spec.cache``): present.<i>.key / .value.
_PRESENT = "present."


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


def _axis(spec: ModelSpec, name: str, dim: str | None) -> int | None:
    shape = next(t.shape for t in (*spec.inputs, *spec.outputs) if t.name == name)
    return shape.index(dim) if dim in shape else None


def layouts(spec: ModelSpec, cache: CacheSpec) -> list[str]:
    """The scenarios a spec's ranges allow: batch 1 where its batch may be 1, the padded
    batch where it may be 2 or more (and a mask that may pad says which tokens are padding)."""
    batch = spec.dims.get(cache.batch_dim or "")
    out = ["batch-1"] if batch is None or batch.min <= 1 else []
    return out + (["left-padded"] if batch is not None and batch.max >= 2 and cache.mask and cache.pads else [])


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
            axis = _axis(spec, t.name, cache.seq_dim)
            value = tokens[t.name]
            feeds[t.name] = value if axis is None else np.take(value, range(start, stop), axis=axis)
    return feeds


def plan_trajectory(spec: ModelSpec, cache: CacheSpec, scenario: str, n_steps: int, seed: int) -> Trajectory:
    """The feeds of one scenario: a prompt step then up to ``n_steps`` steps of one token."""
    n_steps, notes = step_count(spec, cache, n_steps)
    prompt = _prompt_length(spec, cache)
    batch = 1 if scenario == "batch-1" else min(3, spec.dims[cache.batch_dim or ""].max)
    # Rows of different prompt lengths; one is all padding until its first generated token.
    lengths = [prompt] if batch == 1 else [prompt, 0, max(1, prompt // 2)][:batch]
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


def _empty_pasts(spec: ModelSpec, cache: CacheSpec, sizes: Mapping[str, int]) -> Feeds:
    inputs = {t.name: t for t in spec.inputs}
    return {p: np.zeros(concrete_shape(inputs[p], sizes), dtype=inputs[p].dtype) for p, _ in cache.pairs}


def run_trajectory(runtime: Runtime, spec: ModelSpec, traj: Trajectory) -> tuple[list[Feeds], str | None]:
    """Each step's outputs, the runtime feeding back its own presents; stops at the first
    step that cannot run, returning why."""
    cache = traj.cache
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


def pytorch_trajectories(
    eager: TorchRuntime, spec: ModelSpec, cache: CacheSpec, n_steps: int, seed: int
) -> list[tuple[Trajectory, list[Feeds]]]:
    """Every scenario planned and run by the PyTorch module, with its float32 floor at
    every step; a module that cannot decode is a GraphCheckError."""
    out = []
    for scenario in layouts(spec, cache):
        traj = plan_trajectory(spec, cache, scenario, n_steps, seed)
        outputs, error = run_trajectory(eager, spec, traj)
        if error:
            grew = [
                (k + 1, g) for k, o in enumerate(outputs) for g in cache_growth(spec, cache, traj.sizes[k], None, o)
            ]
            before = f"; before that, {grew[0][1].reason(grew[0][0])}" if grew else ""
            raise GraphCheckError(f"{spec.name}: decode {scenario}: PyTorch failed at {error}{before}")
        inputs = step_inputs(spec, traj, outputs)
        allowed = [eager.allowances(i, o) for i, o in zip(inputs, outputs, strict=True)]
        traj.floors, traj.int8 = [f for f, _ in allowed], [r for _, r in allowed]
        _rounded_trajectories(eager, spec, traj, outputs)
        out.append((traj, outputs))
    return out


def _rounded_trajectories(eager: TorchRuntime, spec: ModelSpec, traj: Trajectory, outputs: list[Feeds]) -> None:
    """Each step's rounding as the module rounded like a quantized graph strays over the
    whole trajectory, feeding back its own rounded presents as the graph does (each step
    alone on PyTorch's pasts misses what the earlier steps' rounding left in the cache);
    the larger of the two is kept, by ``rounding_key``."""
    for bits in eager.rounding_bits:
        with eager.rounding(bits) as quantized:
            steps, error = run_trajectory(quantized, spec, traj)
        if error:
            continue  # a module the rounding breaks keeps its per-step roundings
        for k, (exact, approx) in enumerate(zip(outputs, steps, strict=False)):
            for name, value in exact.items():
                key, drift = rounding_key(bits, name), Rounding.between(value, approx[name])
                traj.int8[k][key] = traj.int8[k].get(key, Rounding()).widest(drift)


def step_inputs(spec: ModelSpec, traj: Trajectory, outputs: list[Feeds]) -> list[Feeds]:
    """Each step's feeds with the pasts that ``outputs`` (one side's steps) fed back."""
    cache = traj.cache
    steps = []
    pasts = _empty_pasts(spec, cache, traj.sizes[0])
    for feeds, out in zip(traj.steps, outputs, strict=True):
        steps.append({t.name: pasts[t.name] if t.name in pasts else feeds[t.name] for t in spec.inputs})
        pasts = {past: out[present] for past, present in cache.pairs}
    return steps


def _alone_feeds(spec: ModelSpec, cache: CacheSpec, tokens: Feeds, keep: np.ndarray) -> Feeds:
    """The feeds of one call without a cache on ``tokens`` (every position)."""
    batch, length = keep.shape
    sizes = spec.with_sums(
        example_sizes(spec)
        | {cache.seq_dim: length, cache.past_dim: 0}
        | ({cache.batch_dim: batch} if cache.batch_dim else {})
    )
    return {**_window(spec, cache, tokens, keep, 0, length), **_empty_pasts(spec, cache, sizes)}


def _run_alone(runtime: Runtime, spec: ModelSpec, cache: CacheSpec, tokens: Feeds, keep: np.ndarray) -> Feeds:
    """One call without a cache on ``tokens`` (every position), as the module would see them."""
    return runtime.run(_alone_feeds(spec, cache, tokens, keep))


def one_pass_feeds(spec: ModelSpec, traj: Trajectory, length: int) -> Feeds:
    """The feeds of one pass without a cache over the trajectory's first ``length`` tokens:
    what a step that ends there must agree with, row for row."""
    cache = traj.cache
    assert traj.tokens is not None, "a recorded trajectory has no tokens to recompute"
    tokens = {
        n: v if (a := _axis(spec, n, cache.seq_dim)) is None else np.take(v, range(length), axis=a)
        for n, v in traj.tokens.items()
    }
    return _alone_feeds(spec, cache, tokens, traj.keep[:, :length])


def recompute(runtime: Runtime, spec: ModelSpec, traj: Trajectory) -> Feeds | None:
    """The module without a cache, in one pass over every token of the trajectory (as many
    as the declared seq range holds), or None where not even the prompt fits. Every row of
    every step is compared with the same row of this one pass: a module whose later tokens
    change earlier outputs (no causal mask) or whose result depends on how many keys it
    sees (a scale from the key count) disagrees with it from the first step on."""
    length = pass_length(spec, traj)
    if length < traj.prompt:
        return None
    return runtime.run(one_pass_feeds(spec, traj, length))


def pass_length(spec: ModelSpec, traj: Trajectory) -> int:
    """The tokens ``recompute`` takes in its one pass: as many as the seq range holds."""
    return min(traj.keep.shape[1], spec.dims[traj.cache.seq_dim].max)


def _newest(value: np.ndarray, axis: int, count: int) -> np.ndarray:
    """The last ``count`` positions on ``axis``: the newest ones a cache holds."""
    n = value.shape[axis]
    return np.take(value, range(n - count, n), axis=axis)


def _key_axis(spec: ModelSpec, cache: CacheSpec, name: str) -> int | None:
    """The axis of output ``name`` over cached and new positions: a present's axis 2, or
    an output's ``total_dim``."""
    return 2 if name in {p for _, p in cache.pairs} else _axis(spec, name, cache.total_dim)


def unpadded(
    runtime: Runtime, spec: ModelSpec, traj: Trajectory, outputs: list[Feeds], tolerances: Mapping[str, Tolerance]
) -> list[OutputComparison]:
    """Each left-padded row's real tokens, alone and without padding, against what the
    batch gave them: padding must change nothing a real token sees (a mask the module
    ignores, reads inverted or takes from another row fails here)."""
    cache = traj.cache
    assert traj.tokens is not None and cache.batch_dim is not None, "only a planned, batched trajectory pads"
    found: list[OutputComparison] = []
    # the rows' outputs span every step: the largest float32 error PyTorch made on any
    floors = {t.name: max((f.get(t.name, 0.0) for f in traj.floors), default=0.0) for t in spec.outputs}
    for row, keep in enumerate(traj.keep):
        pad = int((~keep).sum())
        if not pad or keep.size - pad > spec.dims[cache.seq_dim].max:
            continue
        tokens = {}
        for name, value in traj.tokens.items():
            v = np.take(value, [row], axis=_axis(spec, name, cache.batch_dim) or 0)
            a = _axis(spec, name, cache.seq_dim)
            tokens[name] = v if a is None else np.take(v, range(pad, keep.size), axis=a)
        alone = _run_alone(runtime, spec, cache, tokens, np.ones((1, keep.size - pad), dtype=bool))
        batched: Feeds = {}
        theirs: Feeds = {}
        for t in spec.outputs:
            b_axis = _axis(spec, t.name, cache.batch_dim) or 0
            if (s_axis := _axis(spec, t.name, cache.seq_dim)) is not None:
                whole = np.concatenate(
                    [np.take(o[t.name], [row], axis=b_axis) for o in outputs[: len(traj.steps)]], axis=s_axis
                )
                batched[t.name] = np.take(whole, range(pad, whole.shape[s_axis]), axis=s_axis)
                theirs[t.name] = alone[t.name]
            elif (p_axis := _key_axis(spec, cache, t.name)) is not None:
                # the real positions both still hold: every one, unless a window dropped some
                last = np.take(outputs[-1][t.name], [row], axis=b_axis)
                count = min(keep.size - pad, last.shape[p_axis], alone[t.name].shape[p_axis])
                batched[t.name] = _newest(last, p_axis, count)
                theirs[t.name] = _newest(alone[t.name], p_axis, count)
        found += [
            dataclasses.replace(c, name=f"{c.name} (row {row})")
            for c in compare_outputs(batched, theirs, tolerances, floors)
        ]
    return found


@dataclass
class DecodeStep:
    """One step of a trajectory: the graph against the expected side, and (PyTorch mode)
    the cached module against its own full recompute."""

    step: int
    #: The cached positions fed as its past, and its new tokens.
    past: int
    seq: int
    comparisons: list[OutputComparison] = field(default_factory=list)
    recompute: list[OutputComparison] = field(default_factory=list)
    error: str | None = None
    #: Presents that did not grow as declared, on either side (``checks.cache_growth``).
    growth: list[CacheGrowth] = field(default_factory=list)
    #: Its first token's place in the whole sequence (more than ``past`` once a sliding
    #: window dropped tokens); None, as a report without it reads back: ``past``.
    start: int | None = None
    #: The graph's presents that changed what they carry over from their past (``cache_carry``).
    carry: list[CacheCarry] = field(default_factory=list)

    @property
    def first(self) -> int:
        """Its first token's place in the whole sequence."""
        return self.past if self.start is None else self.start

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
            "growth": [g.to_dict() for g in self.growth],
            "start": self.start,
            "carry": [c.to_dict() for c in self.carry],
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
            [CacheGrowth.from_dict(g) for g in d.get("growth", [])],
            d.get("start"),
            [CacheCarry.from_dict(c) for c in d.get("carry", [])],
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
    #: PyTorch: each left-padded row's real tokens alone, against the batch's.
    unpadded: list[OutputComparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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
    def cache_growth(self) -> DecodeStep | None:
        """The first step where a present, the graph's or PyTorch's, did not grow as declared."""
        return next((s for s in self.steps if s.growth), None)

    @property
    def cache_carry(self) -> DecodeStep | None:
        """The first step where the graph changed what a present carries over from its past."""
        return next((s for s in self.steps if s.carry), None)

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.first_divergence is None
            and self.module_bug is None
            and self.cache_growth is None
            and self.cache_carry is None
            and all(c.passed for c in self.unpadded)
        )

    def reasons(self) -> list[str]:
        out = [self.error] if self.error else []
        grew = self.cache_growth
        if grew is not None:
            out.append(grew.growth[0].reason(grew.step))
        carry = self.cache_carry
        if carry is not None:
            out.append(carry.carry[0].reason(carry.step))
        bug = self.module_bug
        if bug is not None:
            why = next(c.reason() for c in bug.recompute if not c.passed)
            out.append(
                f"module bug: with its cache the module disagrees with one pass over every token, from step "
                f"{bug.step} (past {bug.past}, seq {bug.seq}): its rows {bug.first} to {bug.first + bug.seq - 1} "
                f"differ from the same rows of the pass: {why}"
            )
        padded = next((c for c in self.unpadded if not c.passed), None)
        if padded is not None and all(c.passed for c in self.unpadded if not c.name.startswith(_PRESENT)):
            out.append(
                f"module bug: the cache differs, not the outputs: a left-padded row's tokens, alone and unpadded, "
                f"give every output the batch gave them but another {padded.name}: {padded.reason()}"
            )
        elif padded is not None:
            out.append(
                "module bug: padding changes what a real token sees: a left-padded row's tokens, alone and "
                f"unpadded, give other outputs: {padded.reason()}"
            )
        first = self.first_divergence
        if first is not None:
            why = first.error or next(c.reason() for c in first.comparisons if not c.passed)
            out.append(f"first divergence at step {first.step} (past {first.past}, seq {first.seq}): {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        first, bug, grew = self.first_divergence, self.module_bug, self.cache_growth
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
            "cache_growth_from_step": grew.step if grew else None,
            "cache_carry_from_step": carry.step if (carry := self.cache_carry) else None,
            "reasons": self.reasons(),
            "notes": self.notes,
            "unpadded": [c.to_dict() for c in self.unpadded],
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
            [OutputComparison.from_dict(c) for c in d.get("unpadded", [])],
            list(d.get("notes", [])),
        )


def _padded_rows(spec: ModelSpec, cache: CacheSpec, query_keep: np.ndarray) -> dict[str, np.ndarray]:
    """Per output with [batch, ..., seq, ...] axes: True at the rows of padded queries."""
    presents = {present for _, present in cache.pairs}
    out = {}
    for t in spec.outputs:
        if t.name in presents or cache.seq_dim not in t.shape or cache.batch_dim not in t.shape:
            continue
        axis, batch_axis = t.shape.index(cache.seq_dim), t.shape.index(cache.batch_dim)
        shape = [1] * len(t.shape)
        shape[batch_axis], shape[axis] = query_keep.shape
        ordered = query_keep if batch_axis < axis else query_keep.T
        out[t.name] = ~ordered.reshape(shape)
    return out


def _compare(
    expected: Feeds,
    actual: Feeds,
    tolerances: Mapping[str, Tolerance],
    blank: Mapping[str, np.ndarray],
    floors: Mapping[str, float],
    int8: Mapping[str, Rounding] | None = None,
) -> list[OutputComparison]:
    """compare_outputs (tolerances widened by ``floors`` and, for int8, ``int8``), with the
    rows in ``blank`` set to 0 on both sides (not compared)."""

    def cleared(values: Feeds) -> Feeds:
        out = dict(values)
        for name, rows in blank.items():
            if name in out and out[name].ndim == rows.ndim:
                out[name] = np.where(np.broadcast_to(rows, out[name].shape), 0, out[name]).astype(out[name].dtype)
        return out

    left_out = {
        n: np.broadcast_to(rows, expected[n].shape)
        for n, rows in blank.items()
        if n in expected and expected[n].ndim == rows.ndim
    }
    return compare_outputs(cleared(expected), cleared(actual), tolerances, floors, left_out, int8)


def compare_trajectories(
    spec: ModelSpec,
    traj: Trajectory,
    expected: list[Feeds],
    actual: list[Feeds],
    tolerances: Mapping[str, Tolerance],
    actual_error: str | None,
    recomputed: Feeds | None = None,
) -> list[DecodeStep]:
    """Per step: the graph's outputs and presents against the expected side's (padded
    query rows left out under ``fully_masked = "ignore"``), and the expected side's
    against recompute (real tokens only: a padded query has nothing to agree on)."""
    cache = traj.cache
    presents = {present for _, present in cache.pairs}
    # the rows of the one pass that each step's outputs hold: its own tokens of a per-token
    # output, every token so far of a present (the newest, with a window); an output without
    # either is not compared
    rows: dict[str, tuple[int, bool]] = {}
    for t in spec.outputs:
        whole = t.name in presents
        axis = _axis(spec, t.name, cache.total_dim if whole else cache.seq_dim)
        if axis is not None:
            rows[t.name] = (axis, whole)
    length = pass_length(spec, traj) if recomputed is not None else 0
    steps = []
    for k, sizes in enumerate(traj.sizes[: len(expected)]):
        past, seq = sizes[cache.past_dim], sizes[cache.seq_dim]
        start, stop = traj.span(k)
        padded = _padded_rows(spec, cache, traj.keep[:, start:stop])
        graph = actual[k] if k < len(actual) else None
        step = DecodeStep(k + 1, past, seq, start=start)
        step.growth = cache_growth(spec, cache, sizes, graph, expected[k])
        if graph is not None and k > 0:
            pasts = [{past: side[k - 1][present] for past, present in cache.pairs} for side in (actual, expected)]
            step.carry = cache_carry(cache, sizes, (pasts[0], graph), (pasts[1], expected[k]))
        floors = traj.floors[k] if k < len(traj.floors) else {}
        if graph is not None:
            int8 = traj.int8[k] if k < len(traj.int8) else {}
            blank = padded if spec.fully_masked == "ignore" else {}
            step.comparisons = _compare(expected[k], graph, tolerances, blank, floors, int8)
        else:
            step.error = actual_error or "the graph produced no output"
        if recomputed is not None and stop <= length:
            mine: Feeds = {}
            theirs: Feeds = {}
            for n, (a, whole) in rows.items():
                if not whole:
                    mine[n], theirs[n] = np.take(recomputed[n], range(start, stop), axis=a), expected[k][n]
                    continue
                # the positions both hold: the step's present ends at stop, the pass's at length
                offset = length - recomputed[n].shape[a]
                lo = max(stop - expected[k][n].shape[a], offset, 0)
                if lo < stop:
                    mine[n] = np.take(recomputed[n], range(lo - offset, stop - offset), axis=a)
                    theirs[n] = _newest(expected[k][n], a, stop - lo)
            step.recompute = _compare(mine, theirs, tolerances, padded, floors)
        steps.append(step)
        if step.error:
            break
    return steps
