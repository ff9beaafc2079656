"""What bench measures and returns: the options, one row per model x runner x shape (or past
length), and the report with what the figures were measured on (round-trips through JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from attn_export.compare.latency import noise
from attn_export.runtimes.base import RUN_TIMEOUT_S
from attn_export.runtimes.target import DEFAULT_RUNTIME
from attn_export.runtimes.timing import LatencyStats

__all__ = [
    "BenchOptions",
    "BenchReport",
    "BenchRow",
    "DecodeBenchOptions",
    "DecodeBenchReport",
    "DecodeRow",
    "RunnerOptions",
]

PREFILL = "seeded random cache values (a step's cost depends on the cache's shape, not its values)"


@dataclass
class RunnerOptions:
    """What ``bench`` and ``bench --decode`` take alike: which graphs to time on what."""

    batches: Sequence[int] = (1,)
    variants: Sequence[str] = ("fp32", "ort-fused", "int8")
    #: Variants a model's rows may go without where one cannot be made for it (with why,
    #: in ``unavailable``): the default set's rewrites, asked for by no one; any other
    #: graph that fails to build fails the run.
    optional: Sequence[str] = ()
    #: Runner labels left out of a model's rows: an optional variant's graph that could not
    #: be built, or that a runtime asked for cannot load (``bench.unbuilt``).
    skipped: Sequence[str] = ()
    provider: str = "cpu"
    #: Threads for every runner; None means the physical cores.
    threads: int | None = None
    budget_s: float = 0.2
    memory: bool = True
    #: Runtimes (keys of ``runtimes.RUNTIMES``) that run each variant's graph.
    runtimes: Sequence[str] = (DEFAULT_RUNTIME,)
    #: Memory budget per shape in bytes (``model_spec.memory.memory_budget``); None: the default.
    max_memory: int | None = None
    #: Seconds a graph holding a Loop may run its first, untimed call (or decode step) before
    #: it is stopped (``runtimes.ort.bounded``): one without end fails its runner instead of
    #: holding the run.
    region_timeout_s: float = RUN_TIMEOUT_S
    #: Also time ``torch.compile(module, dynamic=True)`` (runner ``torch-compile``); off by
    #: default, as compiling takes seconds per model and shape.
    torch_compile: bool = False


@dataclass
class BenchOptions(RunnerOptions):
    """What ``attn-export bench`` was asked to measure."""

    seqs: Sequence[int] = (64, 128, 256, 512)


@dataclass
class BenchRow:
    """One model x runner x shape."""

    model: str
    runner: str  # torch-eager, torch-sdpa, torch-compile, or ort:<variant>
    batch: int
    seq: int
    latency: LatencyStats
    flops: int
    tokens_per_s: float
    ratio_to_eager: float | None
    gflops: float
    peak_share: float
    in_verified_range: bool
    #: Seconds this shape's first calls spent compiling, outside ``latency`` (0.0 where a
    #: graph compiled earlier served it); None for a runner that compiles nothing.
    compile_s: float | None = None

    @property
    def noise(self) -> str | None:
        """Why this row's timing is too noisy to compare, or None."""
        return noise(self.latency)


@dataclass
class BenchReport:
    """All figures of one bench run, with what they were measured on."""

    machine: str
    versions: dict[str, str]
    threads: int
    provider: str
    peak_gflops: dict[str, float]
    rows: list[BenchRow] = field(default_factory=list)
    #: Peak resident memory (MiB) per model and runner, at the run's largest shape.
    memory_mb: dict[str, dict[str, float | None]] = field(default_factory=dict)
    #: Runners asked for that could not run here, and why (one line each).
    unavailable: dict[str, str] = field(default_factory=dict)
    #: ``model runner`` -> what its row times, where its label does not say (``graph_notes``).
    graph_notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchReport:
        rows = [BenchRow(**{**r, "latency": LatencyStats(**r["latency"])}) for r in d["rows"]]
        return cls(
            d["machine"],
            d["versions"],
            d["threads"],
            d["provider"],
            d["peak_gflops"],
            rows,
            d["memory_mb"],
            d.get("unavailable", {}),
            d.get("graph_notes", {}),
        )


@dataclass
class DecodeBenchOptions(RunnerOptions):
    """What ``attn-export bench --decode`` was asked to measure."""

    #: Past lengths; None means ``DEFAULT_PASTS`` clamped to each spec's past range.
    pasts: Sequence[int] | None = None
    #: Decode steps per window before the cache is reset to its prefilled length.
    window: int = 8
    seed: int = 0
    #: A scenario preset (``model_spec.scenarios.SCENARIOS``): its batch, query tokens per step,
    #: first past and steps replace ``batches``, ``pasts`` and ``window``.
    scenario: str | None = None


@dataclass
class DecodeRow:
    """One model x runner x batch x past length: the cost of one step of ``seq`` tokens."""

    model: str
    runner: str  # torch-eager, torch-compile, or ort:<variant>
    batch: int
    past: int
    #: Steps per window: the timed steps saw past .. past + window - 1.
    window: int
    latency: LatencyStats
    tokens_per_s: float
    ratio_to_eager: float | None
    #: Against eager beyond the noise: "faster", "slower", "within noise"; None for eager.
    verdict: str | None
    #: Query tokens per step: 1 for a decode step, more for a prefill or speculative step.
    seq: int = 1
    #: The scenario preset the row times (``model_spec.scenarios``), if any.
    scenario: str | None = None
    #: Bytes a step moves per token: weights, cache read and cache written (``bench.physics``).
    bytes_per_token: float | None = None
    #: Those bytes over the step's p50: GB/s achieved.
    gbps: float | None = None
    #: The p50 over the time the step's bytes take at the run's copy bandwidth (1.0: at the limit).
    limit_ratio: float | None = None
    #: ONNX Runtime rows: the share of a step's wall time outside node kernels, from a profile.
    outside_kernels: float | None = None
    #: A runner updating its cache in place: whether past and present were one memory at every
    #: step of an untimed window (``OrtDecoder.shares_buffers``); None for the others.
    shared_buffer: bool | None = None
    #: Seconds the window's first pass spent compiling, outside ``latency`` (0.0 where
    #: graphs compiled earlier served it); None for a runner that compiles nothing.
    compile_s: float | None = None

    @property
    def noise(self) -> str | None:
        """Why this row's timing is too noisy to compare, or None."""
        return noise(self.latency)


@dataclass
class DecodeBenchReport:
    """All figures of one ``bench --decode`` run, with what they were measured on."""

    machine: str
    versions: dict[str, str]
    threads: int
    provider: str
    seed: int
    prefill: str = PREFILL
    rows: list[DecodeRow] = field(default_factory=list)
    #: Peak resident memory (MiB) per model and runner: one step at the largest batch and
    #: past, in a fresh process (a plain run, no IOBinding).
    memory_mb: dict[str, dict[str, float | None]] = field(default_factory=dict)
    #: Runners asked for that could not run here, and why (one line each).
    unavailable: dict[str, str] = field(default_factory=dict)
    #: This run's single-threaded copy bandwidth (GB/s, read + written): each row's limit.
    copy_gbps: float | None = None
    #: ``model runner`` -> what its row times, where its label does not say (``graph_notes``).
    graph_notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeBenchReport:
        rows = [DecodeRow(**{**r, "latency": LatencyStats(**r["latency"])}) for r in d["rows"]]
        return cls(
            d["machine"],
            d["versions"],
            d["threads"],
            d["provider"],
            d["seed"],
            d["prefill"],
            rows,
            d["memory_mb"],
            d.get("unavailable", {}),
            d.get("copy_gbps"),
            d.get("graph_notes", {}),
        )
