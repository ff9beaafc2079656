"""Stage: how a decoder's cache grows, step by step (``verify --decode``).

At every step of a trajectory each present must hold exactly what its past and the step's
new tokens make: ``past_seq + seq`` positions on its cache axis (axis 2), or for a
sliding-window cache (``[cache] window = N``, ``model_spec.cache``) the newest
``min(past_seq + seq, N)``; its other axes (batch, kv_heads, head_dim) stay the past's. A
present with more positions is a cache that grows when it should not; one with fewer has lost
tokens. Both sides are checked: the graph, and PyTorch's module at the same step (live, or as
build recorded it). Where only the graph breaks the rule, the export is at fault; where
PyTorch's module breaks it the same way, it is the module's own behaviour, reported as a
module bug. A length is the only thing that shows a sliding-window cache exported without
its trim: it grows by every token while the window mask keeps every logit right. A cache
updated in place (``[cache] max_seq``, the ``static-cache`` variant) must come back at its
buffer's capacity: its runtime refuses any other present (``runtimes.static_cache``) before
cutting it to the positions filled, which are checked here like any cache's.

The positions a present carries over from its past must also be the past's, bit for bit,
where PyTorch's module copies them so (``cache_carry``): a graph that rescales or rewrites
its cache every step drifts without bound over a long generation while its outputs stay
inside a loose tolerance (an int8 chain's) for the few steps verify takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attn_export.artifacts.json_fields import json_record
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import CacheSpec
from attn_export.model_spec.model import concrete_shape

__all__ = ["CacheCarry", "CacheGrowth", "cache_carry", "cache_growth", "expected_present"]


@dataclass
class CacheGrowth:
    """One present whose shape at one step is not what its past and new tokens make: the
    graph's, PyTorch's module's, or both."""

    output: str
    #: The step's cached positions fed as the past, and its new tokens.
    past: int
    seq: int
    #: The cache's window (``[cache] window``); None: a cache that keeps every position.
    window: int | None
    expected: list[int]
    #: The graph's shape and PyTorch's module's at this step; None where that side gave none.
    graph: list[int] | None
    module: list[int] | None

    @property
    def module_wrong(self) -> bool:
        return self.module is not None and self.module != self.expected

    def rule(self) -> str:
        """How the expected length follows from the step's sizes."""
        grown = f"past {self.past} + {self.seq} new"
        if self.window is None:
            return f"{grown} = {self.past + self.seq}"
        return f"min({grown}, window {self.window}) = {min(self.past + self.seq, self.window)}"

    def _only_axis_2(self, shape: list[int]) -> bool:
        pairs = zip(shape, self.expected, strict=False)
        return len(shape) == len(self.expected) and all(a == b for i, (a, b) in enumerate(pairs) if i != 2)

    def _holds(self, shape: list[int]) -> str:
        return f"holds {shape[2]} positions on axis 2" if self._only_axis_2(shape) else f"is {shape}"

    def _want(self) -> str:
        wrong = [s for s in (self.graph, self.module) if s is not None and s != self.expected]
        if all(self._only_axis_2(s) for s in wrong):
            return f"expected {self.rule()}"
        return f"expected {self.expected} (axis 2: {self.rule()}; the other axes the past's)"

    def reason(self, step: int) -> str:
        """One line: the step, the present, expected against what each side gave, and whose
        behaviour it is."""
        where = f"at step {step} (past {self.past}, seq {self.seq})"
        if not self.module_wrong:
            assert self.graph is not None
            module = f"PyTorch's module {self._holds(self.module)}" if self.module else "PyTorch's module gave none"
            return (
                f"cache growth: {where} the graph's {self.output} {self._holds(self.graph)}, {self._want()}; "
                f"{module}: the export's fault, not the module's"
            )
        assert self.module is not None
        if self.graph is None or self.graph == self.module:
            graph = "" if self.graph is None else ", and the graph's the same"
        else:
            graph = f", and the graph's {self._holds(self.graph)}"
        return (
            f"module bug: the module's own cache does not grow as declared: {where} PyTorch's {self.output} "
            f"{self._holds(self.module)}{graph}, {self._want()}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "growth") -> CacheGrowth:
        """What ``to_dict`` wrote; ArtifactError naming the first field missing, unknown or
        not of its type (a decode step is read from a report from anywhere)."""
        return json_record(cls, d, where)


def expected_present(spec: ModelSpec, cache: CacheSpec, sizes: Mapping[str, int], past: str) -> list[int]:
    """The shape a present must have after a step of ``sizes``: its past's, with axis 2 the
    positions the cache keeps of past and new tokens."""
    tensor = next(t for t in spec.inputs if t.name == past)
    shape = list(concrete_shape(tensor, sizes))
    shape[2] = cache.kept(sizes[cache.past_dim] + sizes[cache.seq_dim])
    return shape


def cache_growth(
    spec: ModelSpec,
    cache: CacheSpec,
    sizes: Mapping[str, int],
    graph: Mapping[str, np.ndarray] | None,
    module: Mapping[str, np.ndarray] | None,
) -> list[CacheGrowth]:
    """Every present that either side (the graph's outputs at a step of ``sizes``, PyTorch's
    module's at the same step; None where a side gave none) did not grow as declared."""
    found = []
    for past, present in cache.pairs:
        want = expected_present(spec, cache, sizes, past)
        shapes = [list(o[present].shape) if o is not None and present in o else None for o in (graph, module)]
        if any(s is not None and s != want for s in shapes):
            found.append(
                CacheGrowth(
                    present, sizes[cache.past_dim], sizes[cache.seq_dim], cache.window, want, shapes[0], shapes[1]
                )
            )
    return found


@dataclass
class CacheCarry:
    """One present of the graph's that changed the positions it carries over from its past
    at one step, where PyTorch's module copies them bit for bit."""

    output: str
    past: int
    seq: int
    #: Positions carried over: the present's first ``carried`` are its past's newest.
    carried: int
    max_abs_error: float
    worst_index: list[int]

    def reason(self, step: int) -> str:
        return (
            f"cache carry-over: at step {step} (past {self.past}, seq {self.seq}) the graph's {self.output} changed "
            f"the {self.carried} positions it carries over from its past (max abs {self.max_abs_error:.3g} at "
            f"{self.worst_index}); PyTorch's module copies them bit for bit: a cache rewritten every step drifts "
            "further with each token"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "carry") -> CacheCarry:
        """What ``to_dict`` wrote; ArtifactError naming the first field missing, unknown or
        not of its type (a decode step is read from a report from anywhere)."""
        return json_record(cls, d, where)


def _carried(cache: CacheSpec, sizes: Mapping[str, int], past: np.ndarray, present: np.ndarray) -> np.ndarray | None:
    """|present - past| over the positions the present carries over (its first, the past's
    newest), or None where it carries none or its shape is not what the step makes."""
    p, s = sizes[cache.past_dim], sizes[cache.seq_dim]
    carried = cache.kept(p + s) - s
    if carried <= 0 or past.ndim != 4 or present.shape[:2] != past.shape[:2] or present.shape[3:] != past.shape[3:]:
        return None
    if present.shape[2] != cache.kept(p + s) or past.shape[2] < carried:
        return None
    kept, old = present[:, :, :carried], past[:, :, past.shape[2] - carried :]
    same = (kept == old) | (np.isnan(kept) & np.isnan(old))
    diff = np.abs(kept.astype(np.float64) - old.astype(np.float64))
    return np.where(same, 0.0, np.nan_to_num(diff, nan=np.inf))  # NaN on one side only: infinitely far


def cache_carry(
    cache: CacheSpec,
    sizes: Mapping[str, int],
    graph: tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]],
    module: tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]],
) -> list[CacheCarry]:
    """Every present of the graph's (its pasts and outputs at a step of ``sizes``) that does
    not carry its past's positions over unchanged where PyTorch's module (its own pasts and
    outputs) does."""
    found = []
    for past, present in cache.pairs:
        theirs = _carried(cache, sizes, module[0][past], module[1][present]) if present in module[1] else None
        if theirs is None or theirs.any() or present not in graph[1]:
            continue
        mine = _carried(cache, sizes, graph[0][past], graph[1][present])
        if mine is not None and mine.any():
            worst = [int(i) for i in np.unravel_index(int(np.argmax(mine)), mine.shape)]
            p, s = sizes[cache.past_dim], sizes[cache.seq_dim]
            found.append(CacheCarry(present, p, s, mine.shape[2], float(mine.max()), worst))
    return found
