"""What a decode step must move, and how close a runner comes to moving it at memory speed.

A decode step of a small batch does little arithmetic per byte: it reads every weight once
and the whole cache once, and writes its presents. So its floor is the bytes it moves over
this machine's copy bandwidth, and a row's ``limit_ratio`` (its latency over that floor) says
how far it is from the hardware, where ``ratio_to_eager`` only says how far from PyTorch.

* **Bytes per step**: the runner's weights (a graph's initializers as stored, so int8 weights
  count one byte; the module's parameters and buffers for PyTorch), the cache read (every
  past at the step's length) and the cache written (every present: past + new tokens, since
  separate past and present tensors make each step write the whole cache again).
* **Copy bandwidth**: a single-threaded numpy copy of arrays far larger than any CPU cache,
  counting bytes read and written, as STREAM's Copy does; measured once per run.
* **Time outside kernels**: from ONNX Runtime's profile of the same bound decode steps in a
  separate, profiled session (profiling slows every node, so its times are never the row's):
  the share of a run's wall time not spent in node kernels (per-run and per-node overhead).
  ``profile_calls`` profiles a prefill graph's plain calls the same way.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.artifacts.onnx_file import load_model_file
from attn_export.runtimes.decoders import DecodeWindow
from attn_export.runtimes.placement import read_profile

__all__ = [
    "StepBytes",
    "StepProfile",
    "copy_bandwidth",
    "graph_weight_bytes",
    "module_weight_bytes",
    "outside_kernels",
    "profile_calls",
    "profile_steps",
    "step_bytes",
]


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large numpy copy (read + written), the best of ``repeats``."""
    src = np.random.default_rng(0).standard_normal(mib * 2**20 // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def graph_weight_bytes(path: Path) -> int:
    """Bytes of a graph's initializers as stored (int8 weights count one byte each)."""
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in load_model_file(path).graph.initializer)


def module_weight_bytes(module: Any) -> int:
    """Bytes of a PyTorch module's parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class StepBytes:
    """What one decode step moves, on average over a window."""

    weights: int
    cache_read: int
    cache_written: int

    @property
    def total(self) -> int:
        return self.weights + self.cache_read + self.cache_written


def step_bytes(plan: DecodeWindow, seq: int, weights: int, in_place: bool = False) -> StepBytes:
    """Mean bytes per step of ``plan``'s window of ``seq``-token steps: step k reads pasts of
    the prefilled length plus the k steps before, and writes presents ``seq`` longer, or
    ``in_place`` only the ``seq`` new positions (a sliding-window cache: at most its window)."""
    steps = len(plan.steps)
    per_position = sum(_position_bytes(past) for past in plan.pasts.values())
    lengths = [plan.past + k * seq for k in range(steps)]
    kept = plan.cache.kept  # a sliding-window cache holds at most its window
    read = sum(kept(length) for length in lengths) * per_position
    written = sum(seq if in_place else kept(length + seq) for length in lengths) * per_position
    return StepBytes(weights, read // steps, written // steps)


def _position_bytes(past: np.ndarray) -> int:
    """Bytes of one cache position of a past ``[batch, heads, length, head_dim]``."""
    return int(np.prod([past.shape[0], past.shape[1], *past.shape[3:]])) * past.dtype.itemsize


@dataclass(frozen=True)
class StepProfile:
    """ONNX Runtime's profile of timed runs (bound decode steps, or prefill calls): wall time
    of the runs, kernel time by op type and nodes run. Profiling slows every node: read its
    shares, never its times as latency."""

    runs: int
    run_us: float
    kernel_us: dict[str, float]
    nodes: int

    @property
    def outside(self) -> float:
        """The share of a run's wall time outside node kernels."""
        return max(0.0, 1.0 - sum(self.kernel_us.values()) / self.run_us) if self.run_us else 0.0

    def shares(self) -> dict[str, float]:
        """Each op type's share of kernel time, largest first."""
        total = sum(self.kernel_us.values())
        ranked = sorted(self.kernel_us.items(), key=lambda kv: -kv[1])
        return {op: us / total for op, us in ranked} if total else {}


def _read_steps(path: Path, skip: int = 0) -> StepProfile:
    """The runs of the profile at ``path`` but its first ``skip`` (warm-up) and their nodes."""
    events = read_profile(path)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=_ts)
    start = _ts(runs[skip - 1]) + float(runs[skip - 1]["dur"]) if skip else float("-inf")
    kernels: dict[str, float] = defaultdict(float)
    nodes = 0
    for e in events:
        if e.get("cat") == "Node" and str(e.get("name")).endswith("_kernel_time") and _ts(e) >= start:
            kernels[e["args"]["op_name"]] += e["dur"]
            nodes += 1
    kept = runs[skip:]
    return StepProfile(len(kept), float(sum(e["dur"] for e in kept)), dict(kernels), nodes)


def _ts(event: dict[str, Any]) -> float:
    return float(event.get("ts", 0))


def profile_steps(
    path: Path, signature: Any, plan: DecodeWindow, provider: str, threads: int, steps: int = 50
) -> StepProfile:
    """Profile ``steps`` bound decode steps of ``plan`` in a session of its own, bound as the
    timed runner (``signature``, an activated runtime) binds them."""
    from attn_export.runtimes.decoders import OrtDecoder
    from attn_export.runtimes.ort import load_session

    with tempfile.TemporaryDirectory() as tmp:
        session = load_session(path, provider, threads=threads, spinning=False, profile_prefix=Path(tmp) / "profile")
        static = getattr(signature, "static", None)  # a cache updated in place: bound as the timed runner binds it
        capacity = signature.buffer_capacity if static is not None else 0
        decoder = OrtDecoder(session, signature, plan, provider, static, capacity)
        for _ in range(steps):
            decoder.step()
        return _read_steps(Path(session.end_profiling()))


def profile_calls(
    path: Path, feeds: Mapping[str, np.ndarray], provider: str, threads: int, calls: int = 100, warmup: int = 10
) -> StepProfile:
    """Profile ``calls`` plain calls of a prefill graph on ``feeds`` in a session of its own,
    made as bench makes the timed one, after ``warmup`` calls that the profile leaves out
    (the first calls allocate what the later ones reuse)."""
    from attn_export.runtimes.ort import load_session

    with tempfile.TemporaryDirectory() as tmp:
        session = load_session(path, provider, threads=threads, spinning=False, profile_prefix=Path(tmp) / "profile")
        for _ in range(warmup + calls):
            session.run(None, feeds)
        return _read_steps(Path(session.end_profiling()), skip=warmup)


def outside_kernels(
    path: Path, signature: Any, plan: DecodeWindow, provider: str, threads: int, steps: int = 50
) -> float:
    """The share of a bound decode step's wall time ONNX Runtime spends outside node kernels."""
    return profile_steps(path, signature, plan, provider, threads, steps).outside
