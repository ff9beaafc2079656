"""PyTorch compiled: the module through ``torch.compile(module, dynamic=True)`` (Inductor),
what a PyTorch user would deploy instead of exporting at all.

Compiling is a one-off cost paid at a shape's first calls, and again where Dynamo
recompiles: it specialises a size of 0 or 1, so batch 1 then batch 2 compile twice, and a
decode window from an empty cache compiles at past 0, 1 and 2; past that the cache grows
through one dynamic graph. ``prepare`` and ``decoder`` make those first calls themselves
and keep their seconds in ``compile_s``, so the timed calls are compiled ones only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attn_export._deps import require
from attn_export.errors import AttnExportError, RuntimeFailure, first_line
from attn_export.runtimes.timing import first_calls
from attn_export.runtimes.torch_eager import TorchRuntime

if TYPE_CHECKING:
    from attn_export.runtimes.decoders import Decoder, DecodeWindow

__all__ = ["CompiledTorchRuntime", "inductor_unavailable"]


def inductor_unavailable(device: str) -> str | None:
    """Why Inductor cannot compile for ``device`` on this machine, in one line, or None:
    on CPU it needs a working C++ compiler, on CUDA Triton."""
    require("torch", "torch.compile")
    try:
        from torch._inductor import config
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch.utils._triton import has_triton
    except ImportError as e:
        return f"this torch has no Inductor ({first_line(e)})"
    if device == "cuda":
        return None if has_triton() else "Inductor on CUDA needs Triton, which is not installed (pip install triton)"
    try:
        get_cpp_compiler()
    except Exception:
        tried = ", ".join(str(c) for c in config.cpp.cxx if c) if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
        return f"Inductor needs a C++ compiler and {tried} does not run here (install g++, or name one in CXX)"
    return None


class CompiledTorchRuntime(TorchRuntime):
    """The module through ``torch.compile(dynamic=True)``, in eval mode under
    ``torch.no_grad``, with the same threads as eager (Inductor's CPU kernels take the
    thread count at compile time, which is after ``activate`` sets it).

    Making one resets Dynamo's caches: each model's compile time is its own, and Dynamo's
    limit of 8 graphs per function counts this model's alone (a bench of several models of
    one class would otherwise exhaust it, and Dynamo would run the rest eagerly, silently)."""

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        """``TorchRuntime``'s arguments; ``module`` is compiled lazily, at its first call."""
        torch = require("torch", "torch.compile")
        torch._dynamo.reset()
        super().__init__(torch.compile(module, dynamic=True), *args, **kwargs)
        self.name = f"torch.compile[{self.device}]"

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
        """The call, compiled for these shapes; ``compile_s`` says how long that took."""
        call = super().prepare(feeds)
        self.compile_s = self._compile([call])
        return call

    def decoder(self, plan: DecodeWindow) -> Decoder:
        """The window decoded once (every past length it reaches compiled), then restarted;
        ``compile_s`` says how long compiling took."""
        decoder = super().decoder(plan)
        self.compile_s = self._compile([decoder.step] * len(plan.steps))
        decoder.restart()
        return decoder

    def _compile(self, calls: Sequence[Callable[[], object]]) -> float:
        """Seconds of the first calls that compiled a graph (0.0 when Dynamo reused one)."""
        from torch._dynamo.utils import counters

        try:
            return first_calls(calls, lambda: counters["stats"]["unique_graphs"])
        except AttnExportError as e:
            raise RuntimeFailure(f"{self.name}: {e}") from e
        except Exception as e:
            cause = getattr(e, "inner_exception", None) or e  # Dynamo wraps the backend's error
            raise RuntimeFailure(f"{self.name}: compiling failed: {type(cause).__name__}: {first_line(cause)}") from e
