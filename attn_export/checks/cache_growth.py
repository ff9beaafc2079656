"""Stage: how a decoder's cache grows, step by step (``verify --decode``).

At every step of a trajectory each present must hold exactly what its past and the step's
new tokens make: ``past_seq + seq`` positions on its cache axis (axis 2), or for a
sliding-window cache (``[cache] window = N``, ``spec.cache``) the newest
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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attn_export.spec import ModelSpec
from attn_export.spec.cache import CacheSpec
from attn_export.spec.shapes import concrete_shape

__all__ = ["CacheGrowth", "cache_growth", "expected_present"]


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
    def from_dict(cls, d: Mapping[str, Any]) -> CacheGrowth:
        return cls(**d)


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
