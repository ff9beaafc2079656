"""Where cells run. A cell is one unit of a pipeline's work (verify: a model x target x case)
written as a pure function of a frozen, picklable input that returns a plain record; the
pipelines hand their cells to a ``concurrent.futures.Executor`` chosen here, so a result
never depends on which executor ran it.

``EXECUTORS`` is the registry behind ``--executor``: ``local`` (this process with one job,
else ``--jobs N`` processes) and ``ray`` (a Ray cluster: ``$RAY_ADDRESS``, else a local
one). A new executor is one module and one row.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

from attn_export._deps import missing
from attn_export.errors import AttnExportError, OptionError, RuntimeFailure, first_line

__all__ = [
    "EXECUTORS",
    "SERIAL",
    "ExecutorKind",
    "InlineExecutor",
    "Parallelism",
    "cell_key",
    "exit_if_orphaned",
    "open_executor",
    "run_in_order",
]

T = TypeVar("T")


def cell_key(kind: str, inputs: Any) -> str:
    """The content hash that names a cell: sha256 of its kind and inputs as canonical JSON
    (inputs are plain data: hashes, labels, numbers, never a path's contents by name only)."""
    text = json.dumps([kind, inputs], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class InlineExecutor(Executor):
    """Runs each cell in this process when it is submitted: one job, the default."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


@dataclass(frozen=True)
class ExecutorKind:
    """One row of ``EXECUTORS``."""

    name: str
    #: ``start(jobs, exclusive)``: an Executor running up to ``jobs`` cells at once (None:
    #: its default); with ``exclusive``, never two on one machine.
    start: Callable[[int | None, bool], Executor]
    help: str


#: In a worker process of ``--jobs``: the process that started it (None elsewhere).
_PARENT: int | None = None


def _watch_parent(parent: int) -> None:
    """A local worker's initializer: the worker ends itself within a moment of its parent's
    death (a SIGKILL leaves the parent no time to end it), instead of building for nobody
    into a folder whose lock died with the parent."""
    global _PARENT
    _PARENT = parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.1)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_if_orphaned() -> None:
    """End this worker now if the process that started it has died: called before a cell
    writes, so that no worker writes after its parent has gone (a no-op outside workers)."""
    if _PARENT is not None and os.getppid() != _PARENT:
        os._exit(1)


def _start_local(jobs: int | None, exclusive: bool) -> Executor:
    if not jobs or jobs == 1:
        return InlineExecutor()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked child of a process whose torch or ONNX Runtime thread pools
    # already ran may hang in them.
    return ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_watch_parent,
        initargs=(os.getpid(),),
    )


@contextlib.contextmanager
def _ended_on_signal(executor: Executor) -> Iterator[None]:
    """While a process pool's workers run cells, SIGTERM exits this process as
    ``SystemExit(143)`` (the status the signal itself gives) and, like Ctrl-C, ends the
    workers at once: a worker left running holds its memory and writes for nobody. A SIGTERM
    handler the caller set is kept."""
    from concurrent.futures import ProcessPoolExecutor

    if not isinstance(executor, ProcessPoolExecutor):
        yield
        return
    ours = threading.current_thread() is threading.main_thread()
    ours = ours and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if ours:
        signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        for process in list(executor._processes.values()):  # the pool's own table, as 3.14's terminate_workers
            process.terminate()
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start_ray(jobs: int | None, exclusive: bool) -> Executor:
    from attn_export.executors.ray import RayExecutor

    return RayExecutor(jobs, exclusive)


EXECUTORS: dict[str, ExecutorKind] = {
    "local": ExecutorKind("local", _start_local, "this machine: --jobs processes (1: this process)"),
    "ray": ExecutorKind(
        "ray", _start_ray, "a Ray cluster: $RAY_ADDRESS, else a local one (pip install 'attn-export[ray]')"
    ),
}


#: The most cells at once: more processes than any machine or cluster here runs (a count
#: past a C int stopped the executor with an internal error).
MAX_JOBS = 4096


@dataclass(frozen=True)
class Parallelism:
    """Which executor runs a pipeline's cells, and how many at once (``--executor``,
    ``--jobs``); None jobs: the executor's default (local: 1; ray: the cluster's CPUs)."""

    executor: str = "local"
    jobs: int | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            known = ", ".join(EXECUTORS)
            raise OptionError(f"{{executor}} {{value}}: choose one of {known}", ["executor"], value=self.executor)
        if self.jobs is not None and not 1 <= self.jobs <= MAX_JOBS:
            raise OptionError(f"{{jobs}} {{value}}: give 1 to {MAX_JOBS}, or auto", ["jobs"], value=self.jobs)
        if self.executor == "local" and self.jobs is not None:
            from attn_export.runtimes.timing import THREADS_PER_CPU, usable_cpus

            most = THREADS_PER_CPU * usable_cpus()
            if self.jobs > most:  # a process per cell, each holding PyTorch and its models
                many = f"{{jobs}} {{value}}: more processes than this machine's {usable_cpus()} CPUs run (each holds "
                many += f"its own PyTorch and models): give at most {most}, or run on a Ray cluster ({{executor}})"
                raise OptionError(many, ["jobs", "executor"], value=self.jobs)
        if self.executor == "ray" and importlib.util.find_spec("ray") is None:
            raise missing("ray", "--executor ray")  # before any work, without importing it

    def check_exclusive(self) -> None:
        """UsageError unless cells that time can run here without two on one machine."""
        if self.executor == "local" and (self.jobs or 1) > 1:
            timed = "{jobs} {value}: every cell here is timed, and timings never run side by side on one machine; "
            timed += "spread them over a cluster's machines with {executor} ray"
            raise OptionError(timed, ["jobs", "executor"], value=self.jobs)

    @property
    def parallel(self) -> bool:
        """Whether cells may run beside each other (then timing waits until none runs)."""
        return self.executor != "local" or (self.jobs or 1) > 1


#: One cell after another, in this process: the default.
SERIAL = Parallelism()


@contextlib.contextmanager
def open_executor(parallelism: Parallelism, exclusive: bool = False) -> Iterator[Executor]:
    """The executor, shut down (its processes ended, a local Ray cluster stopped) on exit;
    ``exclusive``: cells that time, which never run two at once on one machine (several
    local jobs are refused)."""
    from concurrent.futures.process import BrokenProcessPool

    if exclusive:
        parallelism.check_exclusive()
    executor = EXECUTORS[parallelism.executor].start(parallelism.jobs, exclusive)
    try:
        with _ended_on_signal(executor):
            yield executor
    except BrokenProcessPool as e:
        raise RuntimeFailure(
            f"a process of --jobs {parallelism.jobs} ended abruptly ({e.__cause__ or 'killed, or out of memory'}); "
            "a script that starts them must guard its own work with if __name__ == '__main__':"
        ) from e
    except Exception as e:
        if not type(e).__module__.startswith("ray."):
            raise
        cause = getattr(e, "cause", None)  # a task's own exception, under Ray's remote traceback
        if isinstance(cause, AttnExportError):
            raise cause.with_traceback(None) from None
        raise RuntimeFailure(f"a Ray task failed: {first_line(cause or e)}") from e
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def run_in_order(
    parallelism: Parallelism, fn: Callable[[Any], T], cells: Sequence[Any], *, exclusive: bool = False
) -> Generator[T, None, None]:
    """``fn`` of each cell, in the cells' order: one cell after another in this process, or
    all submitted at once to a parallel executor (with ``exclusive``, one that never runs
    two on one machine: cells that time). Closing the iterator early cancels the cells not
    started."""
    with open_executor(parallelism, exclusive=exclusive) as executor:
        futures = [executor.submit(fn, c) for c in cells] if parallelism.parallel else []
        for i, cell in enumerate(cells):
            yield (futures[i] if futures else executor.submit(fn, cell)).result()
