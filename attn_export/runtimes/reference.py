"""The ONNX reference evaluator: slow and independent, for cross-checking ONNX Runtime."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.errors import RuntimeFailure, first_line
from attn_export.model_spec import DimRange, ModelSpec, TensorSpec
from attn_export.runtimes.base import Runtime, RuntimeKind
from attn_export.runtimes.target import Target

__all__ = ["KIND", "ReferenceRuntime"]


class ReferenceRuntime(Runtime):
    """``onnx.reference.ReferenceEvaluator``: same ``run(None, feeds)`` call as a session."""

    name = "onnx-reference"

    def __init__(
        self,
        model: Path | bytes,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        self.model = model
        self.evaluator: Any = None

    def _activate(self) -> None:
        import onnx
        from onnx.reference import ReferenceEvaluator

        from attn_export.artifacts.onnx_file import load_model_file

        if isinstance(self.model, Path):
            proto = load_model_file(self.model)  # refuses corrupt files and external data outside its folder
            source: Any = str(self.model)
        else:
            proto = source = onnx.load_from_string(self.model)
        what = self.model.name if isinstance(self.model, Path) else proto.graph.name
        try:
            self.evaluator = ReferenceEvaluator(source)
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: cannot load {what}: {type(e).__name__}: {first_line(e)}") from e

    def _deactivate(self) -> None:
        self.evaluator = None

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.evaluator is not None
        names = [t.name for t in self.outputs]
        try:
            values = self.evaluator.run(names, dict(feeds))
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: inference failed: {type(e).__name__}: {first_line(e)}") from e
        return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


def _make(model: Path | bytes, spec: ModelSpec, target: Target, threads: int | None, budget: int) -> Runtime:
    return ReferenceRuntime(model, spec.inputs, spec.outputs, spec.dims)


#: onnx.reference is pure numpy: its shapes are capped to 16.
KIND = RuntimeKind(name="onnx-reference", make=_make, shape_cap=16, help="onnx.reference at sizes capped to 16")
