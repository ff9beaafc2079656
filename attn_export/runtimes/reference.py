"""The ONNX reference evaluator: slow and independent, for cross-checking ONNX Runtime."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.errors import RuntimeFailure, RunTimeout, first_line
from attn_export.model_spec import DimRange, ModelSpec, TensorSpec
from attn_export.runtimes.base import RUN_TIMEOUT_S, Runtime, RuntimeKind
from attn_export.runtimes.target import Target

__all__ = ["KIND", "ReferenceRuntime", "run_reference_bounded"]


class ReferenceRuntime(Runtime):
    """``onnx.reference.ReferenceEvaluator``: same ``run(None, feeds)`` call as a session."""

    name = "onnx-reference"

    def __init__(
        self,
        model: Path | bytes,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
        timeout_s: float = RUN_TIMEOUT_S,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        self.model = model
        self.evaluator: Any = None
        #: How long one run may take: a Loop checks it before each iteration (``_bounded_loop``).
        self.timeout_s = timeout_s
        self._deadline = [float("inf")]

    def _activate(self) -> None:
        import onnx

        from attn_export.artifacts.onnx_file import load_model_file

        if isinstance(self.model, Path):
            proto = load_model_file(self.model)  # refuses corrupt files and external data outside its folder
            source: Any = str(self.model)
        else:
            proto = source = onnx.load_from_string(self.model)
        what = self.model.name if isinstance(self.model, Path) else proto.graph.name
        try:
            self.evaluator = _bounded(self._deadline, self.timeout_s)(source)
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: cannot load {what}: {type(e).__name__}: {first_line(e)}") from e

    def _deactivate(self) -> None:
        self.evaluator = None

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.evaluator is not None
        names = [t.name for t in self.outputs]
        self._refuse_once_stopped()
        self._deadline[0] = time.monotonic() + self.timeout_s
        try:
            values = self.evaluator.run(names, dict(feeds))
        except RunTimeout as e:
            raise self._stopped_by(e) from e
        except Exception as e:
            raise RuntimeFailure(f"{self.name}: inference failed: {type(e).__name__}: {first_line(e)}") from e
        return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


def _bounded_loop(deadline: list[float], timeout_s: float) -> type:
    """The reference evaluator's ``Loop`` checking ``deadline[0]`` (set before each run)
    before each iteration: of the ops a graph may hold, only a Loop can run without end (ONNX
    Runtime's terminate flag has no counterpart here). Its body runner is set per instance,
    so it is wrapped there."""
    from onnx.reference.ops.op_loop import Loop

    class _Loop(Loop):  # type: ignore[misc]
        op_domain = ""

        def __init__(self, onnx_node: Any, run_params: Any) -> None:
            super().__init__(onnx_node, run_params)
            body: Any = self._run_body  # type: ignore[has-type]  # set by OpRun per instance

            def bounded(*args: Any, **kwargs: Any) -> Any:
                if time.monotonic() > deadline[0]:
                    raise RunTimeout(f"ran past {timeout_s:g} s and was stopped (a Loop without end?)")
                return body(*args, **kwargs)

            self._run_body = bounded

    _Loop.__name__ = "Loop"  # the op type it stands for
    return _Loop


def _bounded(deadline: list[float], timeout_s: float) -> type:
    """``ReferenceEvaluator`` whose every Loop is ``_bounded_loop``'s, a model's functions' too:
    onnx builds each function's evaluator of this class, without the ``new_ops`` given."""
    from onnx.reference import ReferenceEvaluator

    loop = _bounded_loop(deadline, timeout_s)

    class _Bounded(ReferenceEvaluator):  # type: ignore[misc]
        def __init__(self, proto: Any, **kwargs: Any) -> None:
            given = list(kwargs.pop("new_ops", None) or [])  # a subgraph's evaluator is given its parent's
            super().__init__(proto, **kwargs, new_ops=given if loop in given else [*given, loop])

    return _Bounded


def run_reference_bounded(
    model: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray], timeout_s: float
) -> list[np.ndarray]:
    """``names`` from the reference evaluator on ``model``, stopped at a Loop's next iteration
    once ``timeout_s`` seconds have passed (RunTimeout, worded as ``ort.run_bounded``'s)."""
    evaluator = _bounded([time.monotonic() + timeout_s], timeout_s)(model)
    return [np.asarray(v) for v in evaluator.run(list(names), dict(feeds))]


def _make(
    model: Path | bytes,
    spec: ModelSpec,
    target: Target,
    threads: int | None,
    budget: int,
    timeout_s: float = RUN_TIMEOUT_S,
) -> Runtime:
    return ReferenceRuntime(model, spec.inputs, spec.outputs, spec.dims, timeout_s)


#: onnx.reference is pure numpy: its shapes are capped to 16.
KIND = RuntimeKind(name="onnx-reference", make=_make, shape_cap=16, help="onnx.reference at sizes capped to 16")
