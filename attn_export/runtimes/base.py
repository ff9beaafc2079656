"""The runtime interface, and the input checks every runtime shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import numpy as np

from attn_export.errors import InputError, RuntimeFailure, RunTimeout
from attn_export.model_spec import DimRange, ModelSpec, TensorSpec
from attn_export.model_spec.shapes import sizes_from_feeds
from attn_export.runtimes.target import Target

if TYPE_CHECKING:
    from attn_export.runtimes.decoders import Decoder, DecodeWindow
    from attn_export.runtimes.placement import Placement

__all__ = ["Runtime", "RuntimeKind", "check_feeds", "describe_inputs"]


def describe_inputs(inputs: Sequence[TensorSpec], arrays: Sequence[Any], values: Mapping[str, tuple[int, int]]) -> str:
    """``x [2, 3, 16] float32, ids [2, 3] int64 in 0..49``: each input's shape and dtype, and
    the ``values`` of an integer one, as a message about inputs a module failed on says them."""
    return ", ".join(
        f"{t.name} {list(a.shape)} {t.dtype}" + (" in {}..{}".format(*values[t.name]) if t.name in values else "")
        for t, a in zip(inputs, arrays, strict=True)
    )


def check_feeds(
    feeds: Mapping[str, np.ndarray],
    inputs: Sequence[TensorSpec],
    dims: Mapping[str, DimRange] | None = None,
) -> None:
    """Refuse feeds with wrong names, dtypes, ranks or static dims, inconsistent or
    out-of-range symbolic dims, and NaN or Inf values (an additive mask may hold -inf)."""
    want = [t.name for t in inputs]
    missing = [n for n in want if n not in feeds]
    extra = [n for n in feeds if n not in want]
    if missing or extra:
        parts = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else ""]
        raise InputError(f"feeds do not match the inputs {want}: {'; '.join(p for p in parts if p)}")
    for t in inputs:
        arr = feeds[t.name]
        if not isinstance(arr, np.ndarray):
            raise InputError(f"input '{t.name}' is a {type(arr).__name__}, not a numpy array")
        if arr.dtype != np.dtype(t.dtype):
            raise InputError(f"input '{t.name}' has dtype {arr.dtype}, expected {t.dtype}")
        if arr.ndim != len(t.shape):
            raise InputError(f"input '{t.name}' has rank {arr.ndim}, expected {len(t.shape)} {list(t.shape)}")
        for axis, d in enumerate(t.shape):
            if isinstance(d, int) and arr.shape[axis] != d:
                raise InputError(f"input '{t.name}' axis {axis} is {arr.shape[axis]}, expected {d}")
        stray = t.stray_nonfinite(arr)
        if stray:
            raise InputError(stray)
    sizes = sizes_from_feeds(inputs, {k: v.shape for k, v in feeds.items()})
    for name, size in sizes.items():
        if dims and name in dims and not dims[name].min <= size <= dims[name].max:
            r = dims[name]
            raise InputError(f"dim '{name}' is {size}, outside its declared range [{r.min}, {r.max}]")
    for name, r in (dims or {}).items():
        if r.parts and name in sizes and all(p in sizes for p in r.parts):
            total = sum(sizes[p] for p in r.parts)
            if sizes[name] != total:
                raise InputError(f"dim '{name}' is {sizes[name]}, but {' + '.join(r.parts)} is {total}")


class Runtime(ABC):
    """A graph or module that turns named numpy feeds into named numpy outputs.

    Use as a context manager (activate/deactivate). ``run`` checks feeds and state, then
    calls the subclass's ``_run``. ``prepare`` returns a zero-argument call for timing with
    inputs already placed where the runtime wants them; timing itself lives in ``runtimes.timing``.
    """

    #: Short label used in reports, e.g. "onnxruntime[cpu]".
    name: str = "runtime"
    #: Seconds the last ``prepare`` or ``decoder`` spent compiling before any timed call (a
    #: just-in-time compiler's one-off cost, kept out of latency); None where nothing compiles.
    compile_s: float | None = None
    #: Why a run went past its limit and was stopped (``RunTimeout``); None while none has.
    _stopped: str | None = None

    def __init__(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
    ) -> None:
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.dims = dict(dims or {})
        self.active = False

    def __enter__(self) -> Self:
        self.activate()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate()

    def activate(self) -> None:
        if not self.active:
            self._activate()
            self.active = True

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self.active = False

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.active:
            raise RuntimeFailure(f"{self.name}: run() called before activate()")
        check_feeds(feeds, self.inputs, self.dims)
        outputs = self._run(feeds)
        names = [t.name for t in self.outputs]
        if list(outputs) != names:
            raise RuntimeFailure(f"{self.name}: produced outputs {list(outputs)}, expected {names}")
        return outputs

    def _refuse_once_stopped(self) -> None:
        """RuntimeFailure once a run was stopped at its limit: a Loop without end would hold
        every later run for as long."""
        if self._stopped is not None:
            raise RuntimeFailure(f"{self.name}: not run: an earlier run {self._stopped}")

    def _stopped_by(self, e: RunTimeout) -> RuntimeFailure:
        """The failure of a run stopped at its limit, remembered for the runs after it."""
        self._stopped = str(e)
        return RuntimeFailure(f"{self.name}: {e}")

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
        """A zero-argument call running one inference on ``feeds`` (for timing)."""
        check_feeds(feeds, self.inputs, self.dims)
        return lambda: self._run(feeds)

    def decoder(self, plan: DecodeWindow) -> Decoder:
        """This runtime decoding ``plan``'s window of cache steps (activate it first); by
        default through ``run``, with the presents fed back as numpy arrays."""
        from attn_export.runtimes.decoders import FeedbackDecoder

        return FeedbackDecoder(self, plan)

    def placement(self, feeds: Mapping[str, np.ndarray]) -> Placement | None:
        """Which execution provider ran each node on ``feeds`` (``runtimes.placement``),
        read from a run of its own, never a timed one; None for a runtime without providers."""
        return None

    @abstractmethod
    def _activate(self) -> None: ...

    def _deactivate(self) -> None:  # noqa: B027 - most runtimes hold nothing to release
        pass

    @abstractmethod
    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


#: How long one run of a graph holding a Loop, or of a region, may take by default: a case
#: runs in milliseconds to seconds, and a graph from elsewhere is data (a Loop without end
#: ran until the process was killed).
RUN_TIMEOUT_S = 120.0


class MakeRuntime(Protocol):
    """``make(model, spec, target, threads, budget, timeout_s)``: a Runtime for the graph at
    ``model``, holding its own allocations to ``budget`` bytes and a run of a graph holding a
    Loop to ``timeout_s`` seconds (ONNX Runtime's terminate flag; onnx.reference's Loop checks
    the time before each iteration)."""

    def __call__(
        self,
        model: Path | bytes,
        spec: ModelSpec,
        target: Target,
        threads: int | None,
        budget: int,
        timeout_s: float = RUN_TIMEOUT_S,
    ) -> Runtime: ...


@dataclass(frozen=True)
class RuntimeKind:
    """One row of the runtime registry (``runtimes.RUNTIMES``): how to run an ONNX graph."""

    name: str
    make: MakeRuntime
    #: Providers it runs on; empty for a runtime without providers.
    providers: tuple[str, ...] = ()
    #: Every size is capped to this for slow runtimes.
    shape_cap: int | None = None
    #: Latency is measured against PyTorch on this runtime.
    timed: bool = False
    help: str = ""
    #: How bench labels its rows: ``<short>:<variant>`` (the name where empty).
    short: str = ""

    def runner_label(self, variant: str) -> str:
        """A bench row's runner: ``ort:fp32``."""
        return f"{self.short or self.name}:{variant}"

    def targets(self, providers: Sequence[str]) -> list[Target]:
        """This runtime on each requested provider it supports (once if it has none)."""
        if not self.providers:
            return [Target(self.name)]
        return [Target(self.name, p) for p in providers if p in self.providers]
