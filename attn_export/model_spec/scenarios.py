"""Scenario presets for decoders: the shapes a generation really runs, as one registry that
``verify --scenario`` and ``bench --scenario`` both read.

A scenario is a batch, a number of query tokens per step (the prompt for a prefill, 1 for a
decode step, the draft tokens for speculative decoding), the past (cached tokens) at its
first step and a number of steps, each one past the last (past grows by ``seq``). Its dims
are the cache's (``model_spec.cache``); a spec's other symbolic dims take their example sizes. A
scenario that does not fit a spec's declared ranges is refused, naming the dim: it is never
clamped into something else.
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_export.errors import InputError, UsageError
from attn_export.model_spec.cache import CacheSpec, cache_of
from attn_export.model_spec.model import ModelSpec
from attn_export.model_spec.shapes import example_sizes, validate_sizes

__all__ = ["SCENARIOS", "Scenario", "scenario_cache", "scenario_sizes"]


@dataclass(frozen=True)
class Scenario:
    """One preset: ``steps`` calls at ``batch``, each of ``seq`` query tokens, the first over a
    past of ``past`` cached tokens (None: the deepest past the spec's range leaves room for)."""

    name: str
    help: str
    batch: int
    seq: int
    past: int | None
    steps: int

    def describe(self) -> str:
        """The shapes in words, as the docs and ``--help`` list them."""
        steps = f"{self.steps} steps" if self.steps > 1 else "1 step"
        tokens = f"{self.seq} query tokens" if self.seq > 1 else "1 query token"
        past = "ending at the spec's largest past" if self.past is None else f"from past {self.past}"
        return f"batch {self.batch}, {steps} of {tokens} {past}"


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("prefill-cold", "a prompt on an empty cache: the first call of a generation", 1, 16, 0, 1),
        Scenario("decode-early", "one-token steps right after a 16-token prompt", 1, 1, 16, 8),
        Scenario("decode-deep", "one-token steps with the cache as full as the spec allows", 1, 1, None, 8),
        Scenario("speculative", "4 draft tokens checked at once over a past of 20", 1, 4, 20, 1),
        Scenario("batch-prefill", "4 prompts on an empty cache", 4, 16, 0, 1),
        Scenario("batch-decode", "4 sequences decoding one token each after 16-token prompts", 4, 1, 16, 8),
    )
}


def scenario_cache(spec: ModelSpec, name: str) -> CacheSpec:
    """The cache a scenario runs on; UsageError for a spec without one."""
    cache = cache_of(spec)
    if cache is None:
        raise UsageError(
            f"{spec.name}: --scenario {name} needs a decoder with a key/value cache (inputs past_key_values.<i>.key"
            "/value, outputs present.<i>.key/value); it declares none"
        )
    return cache


def scenario_sizes(spec: ModelSpec, name: str) -> list[dict[str, int]]:
    """Each step's sizes (sum dims included); InputError naming the dim where the scenario
    does not fit the spec's declared ranges."""
    scenario = SCENARIOS[name]
    cache = scenario_cache(spec, name)
    past = scenario.past
    if past is None:
        past = max(spec.dims[cache.past_dim].max - (scenario.steps - 1) * scenario.seq, 0)
    if cache.batch_dim is None:
        static = next(t.shape[0] for t in spec.inputs if t.name == cache.pairs[0][0])
        if static != scenario.batch:
            raise InputError(f"{spec.name}: --scenario {name} runs batch {scenario.batch}; its batch is {static}")
    free = {k: v for k, v in example_sizes(spec).items() if k in spec.free_dims}
    steps = []
    for k in range(scenario.steps):
        sizes = free | {cache.seq_dim: scenario.seq, cache.past_dim: past + k * scenario.seq}
        if cache.batch_dim is not None:
            sizes[cache.batch_dim] = scenario.batch
        try:
            validate_sizes(spec, sizes)
        except InputError as e:
            raise InputError(f"--scenario {name} ({scenario.describe()}): {e}") from e
        steps.append(spec.with_sums(sizes))
    return steps
