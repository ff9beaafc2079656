"""What the benchmark scripts share: their timing options and the checks on them, the lines
that say when, where and with what a table was measured, a figure measured in several whole
runs, printed as its median with the lowest and highest in brackets (a ratio whose bracket
holds 1.00 decides nothing), calls timed in rounds of alternating blocks, and which variants
a float32 target may pick."""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["float32_exact", "heading", "repeated", "spread", "started", "timing_arguments"]


def spread(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """``median [lowest–highest]``, each formatted with ``fmt`` and followed by ``unit``."""
    return f"{statistics.median(values):{fmt}}{unit} [{min(values):{fmt}}–{max(values):{fmt}}]"


def float32_exact(variant: str) -> bool:
    """No link of the variant's chain computes below float32 (int8, fp16 do)."""
    from attn_export.model_spec import variant_chain

    return not any("float32" in link.takes for link in variant_chain(variant).links)


def repeated(calls: dict[str, Callable[[], object]], repeats: int, budget_s: float) -> dict[str, list[float]]:
    """Each call's p50 (ms) in each of ``repeats`` rounds of alternating blocks."""
    from attn_export.runtimes.timing import measure_alternating

    p50s: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, stats in measure_alternating(calls, budget_s=budget_s).items():
            p50s[label].append(stats.p50_ms)
    return p50s


def timing_arguments(parser: argparse.ArgumentParser, repeats: str, budget: str, threads: str) -> None:
    """``--repeats``, ``--budget`` and ``--threads``, each with its script's own help."""
    parser.add_argument("--repeats", type=int, default=3, help=repeats)
    parser.add_argument("--budget", type=float, default=1.0, help=budget)
    parser.add_argument("--threads", type=int, help=threads)


def started(
    parser: argparse.ArgumentParser, args: argparse.Namespace, script: str, **more_threads: int | None
) -> tuple[str, int]:
    """The command as run, and the threads on every side (default: the physical cores),
    once the options are checked and torch.compile can run here: a usage error or a one-line
    exit otherwise. The process keeps the memory it frees from now on, before any build
    fills the heap, so that timed calls never page-fault."""
    from attn_export.errors import AttnExportError
    from attn_export.runtimes.allocator import keep_freed_memory
    from attn_export.runtimes.timing import check_threads, physical_cores
    from attn_export.runtimes.torch_compiled import inductor_unavailable

    keep_freed_memory()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        check_threads(args.threads)
        for option, threads in more_threads.items():  # another part's own count (decode's) too
            check_threads(threads, "--" + option.replace("_", "-"))
    except AttnExportError as e:
        parser.error(str(e))
    reason = inductor_unavailable("cpu")
    if reason is not None:
        sys.exit(f"torch-compile: {reason}")
    return " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]), args.threads or physical_cores()


def heading(command: str, machine: str, versions: Mapping[str, str]) -> str:
    """The lines above a table: the day, the machine and the command, then the versions."""
    day = datetime.date.today().isoformat()
    return f"Measured {day} on {machine} with `{command}`\n" + ", ".join(f"{k} {v}" for k, v in versions.items())
