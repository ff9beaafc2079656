"""ONNX Runtime, on one execution provider, with a check that the session really uses it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from attn_export.errors import ProviderError, RuntimeFailure
from attn_export.onnx_file import load_model_file
from attn_export.runtimes.base import Runtime, check_feeds
from attn_export.spec import DimRange, TensorSpec

__all__ = ["PROVIDERS", "OnnxRuntime", "available_providers", "require_provider"]

#: Our short names for ONNX Runtime execution providers.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def available_providers() -> list[str]:
    """Short names of the providers this onnxruntime build offers."""
    import onnxruntime as ort

    by_ep = {v: k for k, v in PROVIDERS.items()}
    return [by_ep.get(p, p) for p in ort.get_available_providers()]


def require_provider(provider: str) -> str:
    """The ONNX Runtime name of ``provider``; ProviderError if this build lacks it."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider '{provider}' (known: {', '.join(PROVIDERS)})")
    ep = PROVIDERS[provider]
    if ep not in ort.get_available_providers():
        hint = " (install onnxruntime-gpu: pip install 'attn-export[gpu]')" if provider == "cuda" else ""
        raise ProviderError(
            f"provider '{provider}' is not available in this onnxruntime; available: "
            f"{', '.join(available_providers())}{hint}"
        )
    return ep


class OnnxRuntime(Runtime):
    """An InferenceSession pinned to one provider; a fallback to another provider fails."""

    def __init__(
        self,
        model: Path | bytes,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
        *,
        provider: str = "cpu",
        threads: int | None = None,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        self.model = model
        self.provider = provider
        self.threads = threads
        self.name = f"onnxruntime[{provider}]"
        self.session = None

    def _activate(self) -> None:
        import onnxruntime as ort

        ep = require_provider(self.provider)
        if isinstance(self.model, Path):
            load_model_file(self.model)  # refuses corrupt files and external data outside its folder
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        try:
            source = str(self.model) if isinstance(self.model, Path) else self.model
            session = ort.InferenceSession(source, sess_options=options, providers=[ep])
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            what = self.model.name if isinstance(self.model, Path) else "the graph"
            raise RuntimeFailure(f"{self.name}: cannot load {what}: {first}") from e
        used = session.get_providers()
        if not used or used[0] != ep:
            raise RuntimeFailure(
                f"{self.name}: session fell back to {', '.join(used) or 'no provider'} instead of {ep}"
            )
        self.session = session

    def _deactivate(self) -> None:
        self.session = None

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.session is not None
        names = [t.name for t in self.outputs]
        try:
            values = self.session.run(names, dict(feeds))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeFailure(f"{self.name}: inference failed: {first}") from e
        return dict(zip(names, values, strict=True))

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
        """On CUDA, bind inputs and outputs on the device (IOBinding) so no copy is timed."""
        if self.provider != "cuda":
            return super().prepare(feeds)
        import onnxruntime as ort

        check_feeds(feeds, self.inputs, self.dims)
        assert self.session is not None
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        for t in self.outputs:
            binding.bind_output(t.name, "cuda")
        session = self.session

        def call() -> None:
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()

        return call
