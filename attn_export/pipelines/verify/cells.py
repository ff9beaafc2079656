"""Verify's cells: one model x target x case (its numbers), the same case's timing, and one
model's decode trajectories, each a pure function of a frozen input that returns a
``Record``, so that any executor (``attn_export.executors``) may run them.

A process keeps the last graph it loaded (``TargetRun``: session, PyTorch original,
expected outputs' source) for the next cell of the same model and target: loading is
keyed by the content it loads, and no result depends on what was kept.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from attn_export.artifacts.golden import GoldenCase, Sight, read_sights
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.checks.decode.results import DecodeResult
from attn_export.checks.fully_masked import FullyMaskedRows
from attn_export.compare import latency_gate
from attn_export.errors import AttnExportError, UsageError
from attn_export.executors import cell_key
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import CacheSpec
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.memory import memory_budget
from attn_export.model_spec.tolerance import rounding_bits
from attn_export.pipelines.verify.expected import (
    Expected,
    case_plan,
    golden_expected,
    int4_activations,
    recorded_expected,
    target_tolerances,
    torch_expected,
)
from attn_export.pipelines.verify.models import build_golden
from attn_export.pipelines.verify.placement import model_placement
from attn_export.pipelines.verify.results import CaseResult, PlacementResult, VerifyOptions
from attn_export.pipelines.verify.trajectories import decode_model
from attn_export.runtimes import RUNTIMES, Runtime, Target
from attn_export.runtimes.timing import LatencyStats, measure_alternating

__all__ = [
    "CaseCell",
    "DecodeCell",
    "ModelWork",
    "Record",
    "TargetRun",
    "TargetWork",
    "check_case",
    "check_cases",
    "decode_cell",
    "placement_cell",
    "placement_key",
    "release",
    "time_case",
]

T = TypeVar("T")


def read_golden_sights(out_dir: Path, entry: ManifestEntry, options: VerifyOptions) -> dict[str, Sight]:
    """Golden mode with recorded inputs: what a query sees, as the build recorded it."""
    if not options.golden or not options.inputs_file:
        return {}
    return read_sights(out_dir / entry.golden, entry.model_spec, memory_budget(options.max_memory), out_dir)


def read_model_golden(out_dir: Path, entry: ManifestEntry, options: VerifyOptions) -> list[GoldenCase]:
    """Golden mode: the golden file's cases (the sweep's and the decode steps'); none when
    recorded inputs replace the sweep. The manifest's spec is data: its max_memory is not obeyed."""
    if not options.golden or options.inputs_file:
        return []
    return build_golden(out_dir, entry, memory_budget(options.max_memory))


class TargetRun:
    """One graph on one target, ready to check any case of its sweep: the runtime loaded,
    the source of expected outputs (``module``, PyTorch; else the ``golden`` cases or the
    recorded inputs' outputs) and the judge of fully masked rows. Use as a context manager."""

    def __init__(
        self,
        name: str,
        path: Path,
        spec: ModelSpec,
        target: Target,
        options: VerifyOptions,
        variant: str = "fp32",
        module: Any = None,
        golden: Sequence[GoldenCase] = (),
        plain: Path | None = None,
        golden_sights: Mapping[str, Sight] | None = None,
    ) -> None:
        self.name, self.path, self.spec, self.target, self.options = name, path, spec, target, options
        self.variant, self.module, self.golden, self.plain = variant, module, list(golden), plain
        self.golden_sights = golden_sights
        self.kind = RUNTIMES[target.runtime]
        self.eager: Runtime | None = None
        self.activation_error: str | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TargetRun:
        with self._stack as stack:
            self._open(stack)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _open(self, stack: contextlib.ExitStack) -> None:
        from attn_export.runtimes.torch_eager import TorchRuntime, torch_device_for

        spec, options, kind = self.spec, self.options, self.kind
        budget = memory_budget(options.max_memory, spec)
        tolerances = target_tolerances(spec, self.variant, options, self.target, self.path)
        self.rows = stack.enter_context(FullyMaskedRows(spec, self.path, tolerances, budget, self.plain))
        self.expected: Expected
        if self.module is None:
            file = options.inputs_file
            if file:
                self.expected = recorded_expected(spec, file, budget, golden_sights=self.golden_sights)
            else:
                self.expected = golden_expected(self.golden)
        else:
            device = torch_device_for(self.target.provider) if kind.timed else "cpu"
            threads = options.threads if kind.timed else None
            bits = rounding_bits(tolerances.values())  # the simulations this variant is judged by, no more
            eager = TorchRuntime(
                self.module,
                spec.inputs,
                spec.outputs,
                spec.dims,
                device=device,
                threads=threads,
                rounding_bits=bits,
                int4_activations=int4_activations(self.path, bits),
            )
            stack.enter_context(eager)
            if options.inputs_file:
                self.expected = recorded_expected(spec, options.inputs_file, budget, eager)
            else:
                self.expected = torch_expected(eager, spec, case_plan(spec, options, kind.shape_cap), options.seed)
            self.eager = eager if kind.timed else None
        self.runtime = kind.make(self.path, spec, self.target, options.threads, budget, options.region_timeout_s)
        try:
            self.runtime.activate()
        except UsageError:
            raise
        except AttnExportError as e:
            self.activation_error = str(e)
        stack.callback(self.runtime.deactivate)

    def check(self, i: int) -> CaseResult:
        """Case ``i``'s numbers: run, compare, judge (no timing)."""
        p = self.expected.plan[i]
        result = CaseResult(
            self.name, self.target, p.label, dict(p.sizes), p.seed, self.expected.label, distribution=p.distribution
        )
        if self.activation_error is not None:
            result.error = self.activation_error
            return result
        case = self.expected.case(i)
        try:
            got = self.runtime.run(case.inputs)
        except UsageError:
            raise
        except AttnExportError as e:
            result.error = str(e)
            return result
        result.comparisons, result.notes = self.rows.compare(case, got, (self.expected.label, result.runtime))
        return result

    def timed(self, result: CaseResult) -> bool:
        """Whether a checked case is timed: the runtime kind is, the values are unit normal, and it ran."""
        return (
            self.options.latency
            and self.kind.timed
            and result.distribution == DEFAULT_DISTRIBUTION
            and result.error is None
        )

    def time(self, i: int) -> tuple[LatencyStats, LatencyStats | None]:
        """Case ``i``'s latency on the target and in PyTorch (where it runs here), in
        alternating blocks with the same threads (``runtimes.timing.measure_alternating``)."""
        feeds = self.expected.case(i, outputs=False).inputs
        calls = {"onnx": self.runtime.prepare(feeds)}
        if self.eager is not None:
            calls["torch"] = self.eager.prepare(feeds)
        stats = measure_alternating(calls, budget_s=2 * self.options.latency_budget_s)
        return stats["onnx"], stats.get("torch")


def set_latency(result: CaseResult, stats: tuple[LatencyStats, LatencyStats | None], options: VerifyOptions) -> None:
    """A checked case's timings, and the latency gate they pass or fail."""
    result.onnx_latency, result.torch_latency = stats
    result.gate = latency_gate(result.onnx_latency, result.torch_latency, options.max_slowdown)


@dataclass(frozen=True)
class ModelWork:
    """What every cell of one model shares: plain data, pickled to the worker."""

    out_dir: Path
    entry: ManifestEntry
    #: The checkout's spec (against PyTorch) or the manifest's (golden mode).
    spec: ModelSpec
    options: VerifyOptions

    def content(self) -> list[Any]:
        """What its cells load and how they judge it: the graph's (and golden file's) hash,
        the spec, the options."""
        e, o = self.entry, self.options
        return [e.sha256, e.golden_sha256 if o.golden else None, e.variant, self.spec.to_dict(), o.settings(), o.seed]


@dataclass(frozen=True)
class TargetWork(ModelWork):
    """What every cell of one model x target shares."""

    #: The same model's plain export in ``out_dir``, intact (``plain_export``), which labels
    #: the cases' fully masked rows where this graph has nothing to rewrite; None where there is none.
    plain: ManifestEntry | None
    target: Target

    @functools.cached_property
    def key(self) -> str:
        """Hashed once per target (each of its case cells' keys is made from it)."""
        plain = self.plain.sha256 if self.plain else None
        return cell_key("verify-target", [*self.content(), plain, self.target.label])

    def open(self) -> TargetRun:
        sights = read_golden_sights(self.out_dir, self.entry, self.options)
        if self.options.golden:
            golden, module = read_model_golden(self.out_dir, self.entry, self.options), None
        else:
            from attn_export.exporter.factory import instantiate

            golden, module = [], instantiate(self.spec)
        path = self.out_dir / self.entry.file
        plain = self.out_dir / self.plain.file if self.plain else None
        return TargetRun(
            self.entry.name,
            path,
            self.spec,
            self.target,
            self.options,
            self.entry.variant,
            module,
            golden,
            plain,
            sights,
        )


@dataclass(frozen=True)
class CaseCell:
    """Case ``index`` of a model x target's sweep."""

    work: TargetWork
    index: int

    @property
    def key(self) -> str:
        return cell_key("verify-case", [self.work.key, self.index])


@dataclass(frozen=True)
class DecodeCell:
    """One model's decode trajectories on every target."""

    work: ModelWork
    cache: CacheSpec

    @property
    def key(self) -> str:
        return cell_key("verify-decode", self.work.content())


@dataclass
class Record(Generic[T]):
    """What a cell returns: its value, or why the model cannot be verified (``problem``, a
    failed check), or the bad usage that ends the run (``usage``, exit 2)."""

    key: str
    value: T | None = None
    problem: str | None = None
    usage: UsageError | None = None

    def get(self) -> T | None:
        """The value; raises the cell's UsageError; None where ``problem`` says why there is none."""
        if self.usage is not None:
            raise self.usage
        return self.value


def _record(key: str, work: Callable[[], T]) -> Record[T]:
    try:
        return Record(key, work())
    except UsageError as e:
        return Record(key, usage=e.with_traceback(None))
    except AttnExportError as e:
        return Record(key, problem=str(e))


_OPEN: dict[str, TargetRun] = {}


def _target_run(work: TargetWork) -> TargetRun:
    """This process's loaded graph for ``work``, loading it (and releasing the one before)."""
    key = work.key
    if key not in _OPEN:
        release()
        _OPEN[key] = work.open().__enter__()
    return _OPEN[key]


def release() -> None:
    """Close the graph this process keeps for the next cell."""
    while _OPEN:
        _OPEN.popitem()[1].__exit__(None, None, None)


def check_case(cell: CaseCell) -> Record[tuple[CaseResult, bool]]:
    """The case's numbers, and whether it is to be timed."""

    def work() -> tuple[CaseResult, bool]:
        run = _target_run(cell.work)
        result = run.check(cell.index)
        return result, run.timed(result)

    return _record(cell.key, work)


def check_cases(cells: Sequence[CaseCell]) -> list[Record[tuple[CaseResult, bool]]]:
    """Several cases, as one task (cells of one graph, sent to one worker together)."""
    return [check_case(cell) for cell in cells]


def time_case(cell: CaseCell) -> Record[tuple[LatencyStats, LatencyStats | None]]:
    """The case's latency: run it when no other cell runs."""
    return _record(cell.key, lambda: _target_run(cell.work).time(cell.index))


def placement_key(work: ModelWork) -> str:
    """The placement cell's key: one per model's work."""
    return cell_key("verify-placement", work.content())


def placement_cell(work: ModelWork) -> Record[list[PlacementResult]]:
    """Where ONNX Runtime ran each node of the model's graph, on every target: a profiled run
    of its own (``placement.model_placement``), never beside a timed one."""
    path = work.out_dir / work.entry.file
    return _record(placement_key(work), lambda: model_placement(work.entry.name, path, work.spec, work.options))


def decode_cell(cell: DecodeCell) -> Record[list[DecodeResult]]:
    def work() -> list[DecodeResult]:
        w = cell.work
        golden = read_model_golden(w.out_dir, w.entry, w.options)
        return decode_model(w.out_dir, w.entry, w.spec, cell.cache, w.options, golden)

    return _record(cell.key, work)
