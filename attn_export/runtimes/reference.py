"""The ONNX reference evaluator: slow and independent, for cross-checking ONNX Runtime."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from attn_export.errors import RuntimeFailure
from attn_export.onnx_file import load_model_file
from attn_export.runtimes.base import Runtime
from attn_export.spec import DimRange, TensorSpec

__all__ = ["ReferenceRuntime"]


class ReferenceRuntime(Runtime):
    """``onnx.reference.ReferenceEvaluator``: same ``run(None, feeds)`` call as a session."""

    name = "onnx-reference"

    def __init__(
        self,
        path: Path,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        self.path = path
        self.evaluator = None

    def _activate(self) -> None:
        from onnx.reference import ReferenceEvaluator

        load_model_file(self.path)  # refuses corrupt files and external data outside its folder
        try:
            self.evaluator = ReferenceEvaluator(str(self.path))
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: cannot load {self.path.name}: {type(e).__name__}: {e}") from e

    def _deactivate(self) -> None:
        self.evaluator = None

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.evaluator is not None
        names = [t.name for t in self.outputs]
        try:
            values = self.evaluator.run(names, dict(feeds))
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: inference failed: {type(e).__name__}: {e}") from e
        return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}
