"""Runtimes decoding a window of steps with a key/value cache, each feeding its own presents
back as the next step's pasts: the call ``bench --decode`` times.

Every ``Runtime`` has ``decoder(plan)``: by default a numpy round trip through ``run``
(``FeedbackDecoder``); PyTorch keeps its presents as torch tensors (``EagerDecoder``), and
ONNX Runtime binds inputs and outputs (``OrtDecoder``) so nothing crosses numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from attn_export._deps import require
from attn_export.errors import RuntimeFailure
from attn_export.model_spec import TensorSpec
from attn_export.model_spec.cache import CacheSpec
from attn_export.runtimes.static_cache import StaticCache

__all__ = ["DecodeWindow", "Decoder", "EagerDecoder", "FeedbackDecoder", "OrtDecoder", "Signature"]

Feeds = dict[str, np.ndarray]


@dataclass
class DecodeWindow:
    """What one window of decode steps feeds: the prefilled pasts, and per step the other
    inputs (the same token every step; the mask and positions grow with the cache)."""

    cache: CacheSpec
    past: int
    pasts: Feeds
    steps: list[Feeds]
    #: New tokens per step.
    seq: int = 1

    def feeds(self, step: int, pasts: Mapping[str, np.ndarray]) -> Feeds:
        """Step ``step``'s full feeds with ``pasts``, for a plain ``run``."""
        return {**self.steps[step], **pasts}


class Decoder(Protocol):
    """A runtime decoding ``plan``'s window: ``step`` runs one step (the window restarts
    from the prefilled cache when it is used up), ``outputs`` copies the last step's."""

    def restart(self) -> None: ...

    def step(self) -> None: ...

    def outputs(self) -> Feeds: ...


class Signature(Protocol):
    """Named inputs and outputs in order: a ``ModelSpec`` or a ``Runtime``."""

    @property
    def inputs(self) -> Sequence[TensorSpec]: ...

    @property
    def outputs(self) -> Sequence[TensorSpec]: ...


class _Runs(Signature, Protocol):
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class FeedbackDecoder:
    """Any runtime decoding a window through ``run``: numpy feeds in, numpy outputs out,
    each step's presents fed back as the next step's pasts."""

    def __init__(self, runtime: _Runs, plan: DecodeWindow) -> None:
        self.runtime = runtime
        self.plan = plan
        self.restart()

    def restart(self) -> None:
        self._k = 0
        self._pasts: Feeds = dict(self.plan.pasts)
        self._last: Feeds = {}

    def step(self) -> None:
        if self._k == len(self.plan.steps):
            self.restart()
        self._last = self.runtime.run(self.plan.feeds(self._k, self._pasts))
        self._pasts = {past: self._last[present] for past, present in self.plan.cache.pairs}
        self._k += 1

    def outputs(self) -> Feeds:
        return {n: v.copy() for n, v in self._last.items()}


class EagerDecoder:
    """The PyTorch module decoding a window: each step's presents (torch tensors) are the
    next step's pasts; after the window it starts again from the prefilled cache."""

    def __init__(self, module: Any, spec: Signature, plan: DecodeWindow, device: str = "cpu") -> None:
        torch = require("torch", "running the PyTorch original")

        self.module = module
        self.plan = plan
        self._names = [t.name for t in spec.inputs]
        self._outputs = [t.name for t in spec.outputs]
        self._steps = [
            {n: torch.from_numpy(np.ascontiguousarray(v)).to(device) for n, v in feeds.items()} for feeds in plan.steps
        ]
        self._prefilled = {n: torch.from_numpy(v).to(device) for n, v in plan.pasts.items()}
        self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self._no_grad = torch.no_grad
        self.restart()

    def restart(self) -> None:
        self._k = 0
        self._pasts: dict[str, Any] = dict(self._prefilled)
        self._last: dict[str, Any] = {}

    def step(self) -> None:
        """One decode step; the window restarts when it is used up."""
        if self._k == len(self._steps):
            self.restart()
        feeds = {**self._steps[self._k], **self._pasts}
        with self._no_grad():
            result = self.module(*(feeds[n] for n in self._names))
        values = result if isinstance(result, tuple | list) else (result,)
        self._last = dict(zip(self._outputs, values, strict=True))
        self._pasts = {past: self._last[present] for past, present in self.plan.cache.pairs}
        self._k += 1
        self._sync()

    def outputs(self) -> Feeds:
        """The last step's outputs as numpy copies (for checks, never timed)."""
        return {n: v.detach().cpu().numpy().copy() for n, v in self._last.items()}


class OrtDecoder:
    """An ONNX Runtime session decoding a window with inputs and outputs bound: the presents
    ONNX Runtime allocates are bound as the next step's pasts, with no numpy round trip.

    For a graph updating its cache in place (``static``: ``runtimes.static_cache``), each
    past and its present are bound once to one buffer of ``capacity`` positions, the
    prefilled cache at its start and every other position NaN (as verify poisons them); a
    step binds only its length and per-step inputs. ``shared`` is the caller's finding that
    the graph writes each present directly into that buffer (``StaticCache.in_place``);
    None for a growing cache."""

    def __init__(
        self,
        session: Any,
        spec: Signature,
        plan: DecodeWindow,
        provider: str = "cpu",
        static: StaticCache | None = None,
        capacity: int = 0,
        shared: bool | None = None,
    ) -> None:
        import onnxruntime as ort

        self.session = session
        self.plan = plan
        self.static = static
        self.shared = shared
        self._device = "cuda" if provider == "cuda" else "cpu"

        self._arrays: list[np.ndarray] = []  # on CPU an OrtValue shares its array's memory: keep them alive

        def value(arr: np.ndarray) -> Any:
            self._arrays.append(np.ascontiguousarray(arr))
            return ort.OrtValue.ortvalue_from_numpy(self._arrays[-1], self._device, 0)

        cache = plan.cache
        per_step = {cache.mask, cache.positions} - {None}
        self._prefilled = {} if static else {n: value(v) for n, v in plan.pasts.items()}
        self._per_step = [{n: value(v) for n, v in feeds.items() if n in per_step} for feeds in plan.steps]
        self._binding = session.io_binding()
        self._fixed = {n: value(v) for n, v in plan.steps[0].items() if n not in per_step}
        for name, v in self._fixed.items():  # bound once: the same token every step
            self._binding.bind_ortvalue_input(name, v)
        # get_outputs() answers in the order outputs were first bound: bind them all now, in
        # the spec's order. Outputs other than the presents keep their shape, so ONNX Runtime
        # reuses their buffer every step; a present grows, so it is bound afresh each step.
        self._outputs = [t.name for t in spec.outputs]
        presents = {present for _, present in cache.pairs}
        self._presents = [name for name in self._outputs if name in presents]
        for name in self._outputs:
            self._binding.bind_output(name, self._device)
        self._sync = self._binding.synchronize_outputs if self._device != "cpu" else (lambda: None)
        self._buffers: dict[str, Any] = {}
        self._initial: dict[str, np.ndarray] = {}
        if static is not None:
            buffers = static.feeds(plan.pasts, capacity)
            for past, present in static.pairs:
                self._initial[present] = buffers[past].copy()  # value() binds this very array, which steps overwrite
                self._buffers[present] = value(buffers[past])
                self._binding.bind_ortvalue_input(past, self._buffers[present])
                self._binding.bind_ortvalue_output(present, self._buffers[present])
            self._presents = []
            for k, feeds in enumerate(self._per_step):
                if static.length is not None:
                    feeds[static.length] = value(np.array(plan.past + k * plan.seq, np.int64))
        # What a step binds, worked out once: a timed step is the binds a deployment makes
        # and the run, none of Python's bookkeeping around them.
        self._binds = [list(feeds.items()) for feeds in self._per_step]
        self.restart()

    def restart(self) -> None:
        self._k = 0
        self._pasts: dict[str, Any] = dict(self._prefilled)

    def step(self) -> None:
        """One decode step; the window restarts when it is used up. A buffer updated in place
        needs no outputs read back each step: ``outputs`` reads them."""
        if self._k == len(self._binds):
            self.restart()
        binding = self._binding
        for name, v in self._binds[self._k]:
            binding.bind_ortvalue_input(name, v)
        if self.static is None:
            for name, v in self._pasts.items():
                binding.bind_ortvalue_input(name, v)
            for name in self._presents:  # rebinding keeps its place, and ONNX Runtime allocates it anew
                binding.bind_output(name, self._device)
        self.session.run_with_iobinding(binding)
        if self.static is None:
            by_name = dict(zip(self._outputs, binding.get_outputs(), strict=True))
            self._pasts = {past: by_name[present] for past, present in self.plan.cache.pairs}
        self._k += 1
        self._sync()

    def shares_buffers(self) -> bool | None:
        """Proof that each present is written into its past's buffer, past and present one
        memory, at every step of the window: the graph writes it there (``shared``,
        ``StaticCache.in_place``), the present comes back at the buffer's address, and the
        step's new positions, poisoned with NaN before it, hold finite values after it
        while the positions before them are as they were. None for a growing cache. Runs
        the window once, untimed, from buffers reset to the prefilled cache."""
        if self.static is None:
            return None
        if not self.shared:
            return False
        for present, buffer in self._buffers.items():
            buffer.update_inplace(self._initial[present])
        self.restart()
        width = self.plan.seq
        for k in range(len(self._binds)):
            filled = self.plan.past + k * width
            before = {present: buf.numpy()[:, :, : filled + width].copy() for present, buf in self._buffers.items()}
            self.step()
            got = dict(zip(self._outputs, self._binding.get_outputs(), strict=True))
            for present, buffer in self._buffers.items():
                now, was = buffer.numpy()[:, :, : filled + width], before[present]
                same_memory = got[present].data_ptr() == buffer.data_ptr()
                written = np.isnan(was[:, :, filled:]).all() and np.isfinite(now[:, :, filled:]).all()
                if not (same_memory and written and np.array_equal(now[:, :, :filled], was[:, :, :filled])):
                    return False
        self.restart()
        return True

    def outputs(self) -> Feeds:
        """The last step's outputs as numpy copies (for checks, never timed); a buffer's
        present as its filled positions."""
        if self._k == 0:  # the binding still holds the last window's outputs, or none
            raise RuntimeFailure("a decoder's outputs are read after a step of its window, not before")
        values = {n: v.numpy().copy() for n, v in zip(self._outputs, self._binding.get_outputs(), strict=True)}
        if self.static is None:
            return values
        filled = self.plan.past + self._k * self.plan.seq
        return {n: v[:, :, :filled] if n in self._buffers else v for n, v in values.items()}
