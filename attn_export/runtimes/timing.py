"""Latency measurement: one place for warm-up, repeats and percentiles.

Runtimes hand over a zero-argument call that already synchronises (CUDA) and keeps
tensors on the device; this module only times it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from attn_export.errors import OptionError, RuntimeFailure
from attn_export.runtimes.allocator import keep_freed_memory

__all__ = [
    "THREADS_PER_CPU",
    "LatencyStats",
    "check_threads",
    "first_calls",
    "load_average",
    "measure",
    "measure_alternating",
    "physical_cores",
    "usable_cpus",
]


@dataclass
class LatencyStats:
    """Wall-clock latency of repeated calls, in milliseconds, and how loaded the machine
    was (1-minute load average and usable cores when the timing ended)."""

    p50_ms: float
    p90_ms: float
    mean_ms: float
    repeats: int
    load: float | None = None
    cores: int | None = None

    @property
    def spread(self) -> float:
        """p90 / p50: how much the repeats disagree."""
        return self.p90_ms / self.p50_ms if self.p50_ms > 0 else float("inf")

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def load_average() -> float | None:
    """The 1-minute load average, where the OS reports one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _stats(times: list[float]) -> LatencyStats:
    ms = np.asarray(times) * 1e3
    return LatencyStats(
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 90)),
        float(ms.mean()),
        len(times),
        load_average(),
        physical_cores(),
    )


def measure(
    call: Callable[[], object],
    *,
    warmup: int = 2,
    budget_s: float = 0.05,
    min_repeats: int = 5,
    max_repeats: int = 10_000,
) -> LatencyStats:
    """Run ``call`` ``warmup`` times untimed, then repeatedly until ``budget_s`` is spent
    (at least ``min_repeats`` times), and report percentiles. The process keeps its freed
    memory from then on (``allocator.keep_freed_memory``)."""
    keep_freed_memory()
    for _ in range(warmup):
        call()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return _stats(times)


def first_calls(calls: Sequence[Callable[[], object]], changed: Callable[[], object], rounds: int = 4) -> float:
    """Run ``calls`` in order, round after round, until a round leaves ``changed()`` as it
    found it (a just-in-time compiler compiled nothing more); return the seconds of the
    calls during which it changed: the one-off cost that ``measure`` must not see. A
    compiler still busy after ``rounds`` rounds is a RuntimeFailure."""
    spent = 0.0
    for _ in range(rounds):
        busy = False
        for call in calls:
            before = changed()
            t0 = time.perf_counter()
            call()
            took = time.perf_counter() - t0
            if changed() != before:
                spent, busy = spent + took, True
        if not busy:
            return spent
    raise RuntimeFailure(f"still compiling after {rounds} rounds of the same {len(calls)} calls")


def measure_alternating(
    calls: dict[str, Callable[[], object]], *, warmup: int = 2, budget_s: float = 0.05, blocks: int = 4
) -> dict[str, LatencyStats]:
    """Time several calls fairly in one process: each is warmed up, then they take turns
    in ``blocks`` blocks of ``budget_s / blocks`` seconds each, so a slow phase of the
    machine (or another runtime's threads still spinning) falls on all of them alike. The
    process keeps its freed memory from then on (``allocator.keep_freed_memory``)."""
    keep_freed_memory()
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(blocks):
        for name, call in calls.items():
            deadline = time.perf_counter() + budget_s / blocks
            while len(times[name]) < 10_000 and (not times[name] or time.perf_counter() < deadline):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    return {name: _stats(t) for name, t in times.items()}


#: Threads a run may ask for, per CPU this process may use: more only oversubscribes the
#: machine (5,000 threads once loaded it to a load average of 900).
THREADS_PER_CPU = 4


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_threads(threads: int | None) -> None:
    """Refuse a thread count (option ``threads``) below 1 or above ``THREADS_PER_CPU`` per
    usable CPU: more only makes the runners fight over the cores, and the timings noise."""
    limit = THREADS_PER_CPU * usable_cpus()
    if threads is not None and not 1 <= threads <= limit:
        per_cpu = f"give 1 to {limit} ({THREADS_PER_CPU} per CPU this process may use)"
        raise OptionError(f"{{threads}} {{value}}: {per_cpu}", ["threads"], value=threads)


def physical_cores() -> int:
    """Physical cores (not hyper-threads) from /proc/cpuinfo, capped by the CPUs this
    process may use (a container may see the host's cores but run on two)."""
    usable = usable_cpus()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return usable
    cores: set[tuple[str, str]] = set()
    phys = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
            cores.add((phys, core))
    return min(len(cores) or usable, usable)
