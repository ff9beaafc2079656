"""How steady this machine is: the same work timed block after block, so that what moves
between blocks is the host (a shared machine's other tenants), not the code. It bounds how
steady any timing here can be, eager's decode step (``decode_perf.py``'s ±15 % target) too.

    python benchmarks/host_speed.py               # 40 blocks of about a second

Each block times a fixed one-thread product of a 512-vector by a 512x512 matrix (20 of them
a sample; the block's p50 over half a second: compute, from the CPU's caches) and copies
64 MiB (the best of three: memory bandwidth). Printed: each figure's median [lowest–highest]
over the blocks and its farthest block from the median as a share of it, the longest run
of blocks more than 15 % slower than the fastest, and the steal time the kernel reports
(time the hypervisor gave this machine's CPUs to another).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from repeats import heading, spread  # benchmarks/repeats.py, next to this script

from attn_export.pipelines.bench.physics import copy_bandwidth
from attn_export.pipelines.bench.runners import timing_machine

#: A block "slow" when its compute p50 is this much over the fastest block's.
SLOW = 1.15


def steal_ticks() -> int | None:
    """The CPUs' steal time so far, in clock ticks (Linux's /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def compute_block(seconds: float) -> float:
    """The p50 (ms) of 20 one-thread 512-vector by 512x512 products, over ``seconds``."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 512, generator=gen), torch.randn(512, 512, generator=gen)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(20):
            x @ w
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def farthest(values: list[float]) -> float:
    """The farthest value from the median, as a share of it."""
    middle = statistics.median(values)
    return max(abs(v / middle - 1) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40, help="blocks of about a second each")
    args = parser.parse_args()
    if args.blocks < 2:
        parser.error("--blocks must be at least 2")
    torch.set_num_threads(1)
    command = " ".join(["python", "benchmarks/host_speed.py", *sys.argv[1:]])
    versions = {"torch": torch.__version__, "numpy": np.__version__}
    before = steal_ticks()
    compute, copy = [], []
    for _ in range(args.blocks):
        compute.append(compute_block(0.5))
        copy.append(copy_bandwidth(64, 3) / 1e9)
    after = steal_ticks()
    stolen = "unknown" if before is None or after is None else f"{after - before} ticks"
    slow = [c > SLOW * min(compute) for c in compute]
    longest = run = 0
    for s in slow:
        run = run + 1 if s else 0
        longest = max(longest, run)
    print(heading(command, timing_machine(), versions))
    print(f"\n{args.blocks} blocks of about a second each, one thread:\n")
    print("| figure | median [lowest–highest] over the blocks | farthest block from the median |")
    print("|---|---|---|")
    for figure, values, fmt in (
        ("512x512 product, p50 of 20 (compute)", compute, (".3f", " ms")),
        ("64 MiB copy (memory bandwidth)", copy, (".1f", " GB/s")),
    ):
        print(f"| {figure} | {spread(values, *fmt)} | ±{100 * farthest(values):.0f} % |")
    print(
        f"\n{sum(slow)} of {args.blocks} blocks were more than {100 * (SLOW - 1):.0f} % slower than the fastest at "
        f"the same work, the longest run of them {longest} blocks; steal time reported: {stolen}. "
        "A figure timed over seconds here is no steadier than the work above."
    )


if __name__ == "__main__":
    main()
