"""A decoder's key/value cache, read from its spec by the names users' runtimes expect.

Inputs ``past_key_values.{i}.key`` / ``.value`` ``[batch, kv_heads, past_seq, head_dim]`` pair
with outputs ``present.{i}.key`` / ``.value`` ``[batch, kv_heads, past_seq + seq, head_dim]``
(Hugging Face Optimum and onnxruntime-genai use these names); ``attention_mask``
``[batch, past_seq + seq]`` and ``position_ids`` ``[batch, seq]`` are fed per step when the
module takes them. Decoding (``checks.decode``) needs nothing else from the spec.

Each step, a present grows by exactly the step's new tokens. A sliding-window cache declares
its window in the spec (``[cache] window = N``): each present keeps its newest
``min(past_seq + seq, N)`` positions, the next step's ``attention_mask`` covers those and the
new tokens (``total_seq`` is still ``past_seq + seq``), and ``position_ids`` keep counting
every token since the first.

``[cache] max_seq`` declares the capacity of a buffer updated in place (the ``static-cache``
variant): it must hold the longest present the dims allow (``past_seq`` max + ``seq`` max),
and each present comes back as that buffer, at that capacity. A cache declares one or the
other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attn_export.errors import InputError, SpecError
from attn_export.model_spec.masks import FULL
from attn_export.model_spec.model import ModelSpec, TensorSpec, concrete_shape

__all__ = [
    "MASK",
    "POSITIONS",
    "CacheSpec",
    "cache_of",
    "counted_positions",
    "check_fed_sizes",
    "fed_points",
    "fed_sizes",
    "output_shape",
    "present_windows",
]

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
MASK = "attention_mask"
POSITIONS = "position_ids"


@dataclass(frozen=True)
class CacheSpec:
    """Which inputs a decoder step feeds back, and the dims that grow."""

    #: (past input, present output) pairs, in input order.
    pairs: tuple[tuple[str, str], ...]
    past_dim: str
    seq_dim: str
    total_dim: str
    mask: str | None
    positions: str | None
    #: Axis 0 of the caches, where symbolic.
    batch_dim: str | None = None
    #: ``[cache] max_seq``: positions of a buffer updated in place; None when undeclared.
    max_seq: int | None = None
    #: The positions each present keeps (the newest): a sliding-window cache; None: all.
    window: int | None = None
    #: ``[cache] extend_batch``: the largest batch of a step of several new tokens on a
    #: filled cache (``fed_sizes``); None: any.
    extend_batch: int | None = None
    #: Whether the mask may pad (its pattern is not "full": a graph that takes no padding).
    pads: bool = True

    def kept(self, length: int) -> int:
        """The positions a present holds after a step whose past and new tokens are ``length``."""
        return length if self.window is None else min(length, self.window)


def cache_of(spec: ModelSpec) -> CacheSpec | None:
    """The spec's cache, or None when it declares no ``past_key_values.*`` input; a cache
    declared half-way is a SpecError naming what is missing."""
    pasts = [t for t in spec.inputs if _PAST.fullmatch(t.name)]

    def bad(message: str) -> SpecError:
        return SpecError(f"{spec.name}: KV cache: {message}")

    declared = [k for k, v in (("max_seq", spec.cache_max_seq), ("window", spec.cache_window)) if v is not None]
    if not pasts:
        if declared:
            raise SpecError(f"{spec.name}: [cache] {declared[0]} needs a past_key_values.* input to hold")
        return None
    if len(declared) > 1:
        raise bad("[cache] declares max_seq and window: a buffer updated in place keeps every position; declare one")
    outputs = {t.name: t for t in spec.outputs}

    past_names = {t.name for t in pasts}
    for t in pasts:
        other = t.name[: -len("key")] + "value" if t.name.endswith(".key") else t.name[: -len("value")] + "key"
        if other not in past_names:
            raise bad(f"input '{t.name}' has no '{other}' beside it")
    pairs, past_dims, total_dims = [], set(), set()
    for t in pasts:
        match = _PAST.fullmatch(t.name)
        assert match is not None
        present = outputs.get(f"present.{match[1]}.{match[2]}")
        if present is None:
            raise bad(f"input '{t.name}' has no output 'present.{match[1]}.{match[2]}'")
        if len(t.shape) != 4 or len(present.shape) != 4:
            raise bad(f"'{t.name}' and '{present.name}' must both be [batch, kv_heads, seq, head_dim]")
        if t.dtype != present.dtype:
            raise bad(f"'{t.name}' is {t.dtype} but '{present.name}' is {present.dtype}")
        if [d for i, d in enumerate(t.shape) if i != 2] != [d for i, d in enumerate(present.shape) if i != 2]:
            shapes = f"{list(t.shape)} vs {list(present.shape)}"
            raise bad(f"'{t.name}' and '{present.name}' differ outside axis 2 ({shapes})")
        past_dims.add(t.shape[2])
        total_dims.add(present.shape[2])
        pairs.append((t.name, present.name))
    past, total = past_dims.pop(), total_dims.pop()
    if past_dims or total_dims or not isinstance(past, str) or not isinstance(total, str):
        raise bad("every past_key_values input must share one past dim on axis 2, every present one sum dim")
    parts = spec.dims[total].parts
    if past not in parts or len(parts) != 2:
        raise bad(f"axis 2 of the presents is '{total}'; declare it in [dims] as \"{past} + <seq dim>\"")
    if spec.dims[past].min != 0:
        raise bad(f"'{past}' needs min = 0: decoding starts from an empty cache")
    if spec.cache_window is not None and spec.cache_window > spec.dims[past].max:
        raise bad(
            f"[cache] window = {spec.cache_window}, but '{past}' max is {spec.dims[past].max}: a full window "
            "is fed back as the next past"
        )
    seq = next(p for p in parts if p != past)
    names = {t.name: t for t in spec.inputs}
    mask, positions = names.get(MASK), names.get(POSITIONS)
    if mask is not None and (len(mask.shape) != 2 or mask.shape[1] != total or mask.mask is None):
        raise bad(f"'{MASK}' must be [batch, {total}], a key-padding mask over past and new tokens")
    if mask is not None and mask.mask is not None and mask.mask.layout != "key-padding":
        raise bad(
            f"'{MASK}' {list(mask.shape)} is read as layout '{mask.mask.layout}'; a cache's mask pads the keys "
            'over past and new tokens: declare layout = "key-padding" on it'
        )
    presents = {p for _, p in pairs}
    stray = [t.name for t in spec.outputs if t.name.startswith("present.") and t.name not in presents]
    if stray:
        raise bad(f"output '{stray[0]}' has no past_key_values input")
    if positions is not None and (list(positions.shape[1:]) != [seq] or not positions.dtype.startswith("int")):
        raise bad(f"'{POSITIONS}' must be integer [batch, {seq}]")
    for t in spec.inputs:
        if t not in pasts and t is not mask and total in t.shape:
            raise bad(f"input '{t.name}' uses '{total}'; only '{MASK}' and the presents may")
    longest = spec.dims[past].max + spec.dims[seq].max
    if spec.cache_max_seq is not None and spec.cache_max_seq < longest:
        raise bad(
            f"max_seq = {spec.cache_max_seq} cannot hold a present of {longest} positions "
            f"('{past}' max {spec.dims[past].max} + '{seq}' max {spec.dims[seq].max}); raise it or narrow the dims"
        )
    batch = pasts[0].shape[0]
    return CacheSpec(
        tuple(pairs),
        past,
        seq,
        total,
        MASK if mask else None,
        POSITIONS if positions else None,
        batch if isinstance(batch, str) else None,
        spec.cache_max_seq,
        spec.cache_window,
        spec.cache_extend_batch,
        mask is None or mask.mask is None or mask.mask.pattern != FULL,
    )


def fed_sizes(spec: ModelSpec, sizes: Mapping[str, int]) -> dict[str, int]:
    """``sizes`` as a graph of ``[cache] extend_batch`` is fed: a step of several new tokens
    on a filled cache at that batch at most (onnxruntime-genai's generator feeds a prompt on
    an empty cache, then one token a step; its GroupQueryAttention refuses the rest)."""
    cache = cache_of(spec)
    fed = spec.with_sums(sizes)
    if cache is None or cache.extend_batch is None or cache.batch_dim is None:
        return fed
    if fed[cache.past_dim] > 0 and fed[cache.seq_dim] > 1 and fed[cache.batch_dim] > cache.extend_batch:
        fed[cache.batch_dim] = max(spec.dims[cache.batch_dim].min, cache.extend_batch)
    return spec.with_sums(fed)


def fed_points(spec: ModelSpec, sizes: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Where ``[cache] extend_batch`` moves points of a sweep to a smaller batch, the two
    steps a generator feeds at the largest batch, from ``sizes``: a prompt on an empty cache
    and one new token on a filled one; none for any other spec."""
    cache = cache_of(spec)
    if cache is None or cache.extend_batch is None or cache.batch_dim is None:
        return {}
    batch, past, seq = (spec.dims[d] for d in (cache.batch_dim, cache.past_dim, cache.seq_dim))
    widest = {**sizes, cache.batch_dim: batch.max}
    return {
        "prompt": spec.with_sums({**widest, cache.past_dim: past.min}),
        "step": spec.with_sums(
            {**widest, cache.seq_dim: max(seq.min, 1), cache.past_dim: max(sizes[cache.past_dim], 1)}
        ),
    }


def check_fed_sizes(spec: ModelSpec, sizes: Mapping[str, int]) -> None:
    """InputError where ``sizes`` (given by the user) are sizes ``fed_sizes`` would change."""
    cache = cache_of(spec)
    if cache is not None and cache.batch_dim is not None and fed_sizes(spec, sizes) != spec.with_sums(sizes):
        raise InputError(
            f"{spec.name}: {cache.batch_dim}={sizes[cache.batch_dim]} with {cache.seq_dim}={sizes[cache.seq_dim]} new "
            f"tokens on a filled cache ({cache.past_dim}={sizes[cache.past_dim]}): the spec's [cache] extend_batch = "
            f"{cache.extend_batch} says the graph takes several new tokens on a filled cache at batch "
            f"{cache.extend_batch} at most"
        )


def present_windows(spec: ModelSpec) -> dict[str, int]:
    """Each present of a sliding-window cache and its window (axis 2 keeps at most that
    many positions); empty for a cache that keeps every position, or no cache."""
    cache = cache_of(spec)
    if cache is None or cache.window is None:
        return {}
    return {present: cache.window for _, present in cache.pairs}


def output_shape(spec: ModelSpec, tensor: TensorSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """An output's shape at ``sizes``: the declared one, except that a sliding-window
    cache's present holds at most its window on axis 2."""
    shape = concrete_shape(tensor, sizes)
    window = present_windows(spec).get(tensor.name)
    return shape if window is None else (*shape[:2], min(shape[2], window), *shape[3:])


#: Mask conventions whose ones (True) are the tokens a row holds: what ``gqa-rotary`` counts.
COUNTED_CONVENTIONS = ("binary", "attend")


def _uses_window(config: Any) -> bool:
    """Whether ``config``'s class may turn its window off (Qwen2's ``use_sliding_window``) and
    has not: a class without that field (Mistral) keeps it as an attribute of its own and
    applies its window all the same."""
    import inspect

    try:
        takes = "use_sliding_window" in inspect.signature(type(config)).parameters
    except (TypeError, ValueError):  # a class whose signature cannot be read: read the attribute
        takes = True
    return getattr(config, "use_sliding_window", True) is not False if takes else True


def counted_positions(spec: ModelSpec, label: str | None = None, config: Any = None) -> int:
    """How many positions a graph that counts them itself (``gqa-rotary``: each row's
    filled length plus each token's index) reaches, SpecError where the spec's positions
    are not that count: a ``position_ids`` input the graph would ignore, or a mask that
    pads on the left (its rows count from their first real token) or whose ones are not
    the tokens (an additive or an ignore mask); or where the config's
    sliding window is shorter than those positions (the graph keeps no mask but lengths):
    ``config``'s, the object the spec's config table makes (its class's default window
    included), else the table's. Errors begin with ``label`` (default: the spec's name; a
    build names the graph)."""
    label = label or spec.name
    cache = cache_of(spec)
    if cache is None:
        raise SpecError(f"{label}: positions counted from a cache's length need a KV cache (past_key_values.*)")
    if cache.positions is not None:
        raise SpecError(
            f"{label}: the graph counts positions from its cache's length and would ignore '{cache.positions}': "
            'build a module that counts them from the mask (CausalLMWithCache(positions="mask")) without that input'
        )
    if cache.mask is not None and cache.pads:
        raise SpecError(
            f"{label}: the graph counts each token's position from its row's ones in '{cache.mask}', as "
            "onnxruntime-genai's graphs do, where a left-padded row counts from its first real token: "
            f'declare mask = "{FULL}" on it (onnxruntime-genai pads on the right, which the graph reads)'
        )
    mask = next((t.mask for t in spec.inputs if t.name == cache.mask), None)
    if mask is not None and mask.convention.name not in COUNTED_CONVENTIONS:
        raise SpecError(
            f"{label}: the graph counts each row's length as the ones (True) in '{cache.mask}', which its "
            f"convention '{mask.convention.name}' does not mean: give it a mask of convention "
            f"{' or '.join(COUNTED_CONVENTIONS)} (1 = attend, as tokenizers and onnxruntime-genai give it)"
        )
    reached = reached_positions(spec)
    window = short_window(spec, config)
    if window is not None:
        raise SpecError(
            f"{label}: the graph reads the mask for each row's length alone, and the config's "
            f"sliding_window = {window} is shorter than the {reached} positions it reaches: it would attend "
            "past the window; build it without gqa-rotary"
        )
    return reached


def reached_positions(spec: ModelSpec) -> int:
    """How many positions a decoder's cache reaches: its buffer's capacity, else the longest
    past plus the longest step."""
    cache = cache_of(spec)
    assert cache is not None, "a decoder with a KV cache"
    return cache.max_seq or spec.dims[cache.past_dim].max + spec.dims[cache.seq_dim].max


def short_window(spec: ModelSpec, config: Any = None) -> int | None:
    """The sliding window of a decoder's config (``config``, the object its table makes, its
    class's default included, else the table) where it is in use and shorter than the
    positions the cache reaches (``reached_positions``); None elsewhere (a spec without a
    cache included)."""
    if cache_of(spec) is None:
        return None
    table = spec.config or {}
    window = getattr(config, "sliding_window", None) if config is not None else table.get("sliding_window")
    used = _uses_window(config) if config is not None else table.get("use_sliding_window", True)
    if isinstance(window, int) and used is not False and window < reached_positions(spec):
        return window
    return None
