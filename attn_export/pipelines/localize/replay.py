"""``attn-export replay``: rerun a bundle's region on its recorded inputs and compare with
PyTorch's recorded value; no torch, no build folder and no checkout, so it runs where a new
ONNX Runtime is deployed and in a bug report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export.artifacts.bundle import TOLERANCE_KEYS, Bundle, left_out_rows, read_bundle
from attn_export.compare.outputs import OutputComparison, judge_value
from attn_export.errors import ArtifactError, RuntimeFailure, first_line
from attn_export.pipelines.localize.judge import left_out, representable
from attn_export.runtimes.ort import load_session
from attn_export.spec import Tolerance
from attn_export.spec.memory import memory_budget

__all__ = ["ReplayResult", "replay_bundle"]


@dataclass
class ReplayResult:
    """The bundle's description and its region's value against PyTorch's."""

    folder: str
    info: dict[str, Any]
    provider: str
    comparison: OutputComparison

    @property
    def passed(self) -> bool:
        return self.comparison.passed


#: ONNX Runtime's names of the element types a bundle's arrays may have.
_ORT_TYPES = {
    "float32": "tensor(float)",
    "float16": "tensor(float16)",
    "float64": "tensor(double)",
    "int64": "tensor(int64)",
    "int32": "tensor(int32)",
    "bool": "tensor(bool)",
}


def _check_fit(folder: Path, session: Any, bundle: Bundle) -> None:
    """The arrays of ``case.npz`` are what ``region.onnx`` takes and gives: a bundle whose
    files do not belong together is bad input, not a region that is wrong."""
    takes = {i.name: i for i in session.get_inputs()}
    if sorted(takes) != sorted(bundle.inputs):
        raise ArtifactError(f"{folder}: region.onnx takes {sorted(takes)}, case.npz holds {sorted(bundle.inputs)}")
    for name, array in bundle.inputs.items():
        want = takes[name]
        fixed = [d if isinstance(d, int) else None for d in want.shape]
        fits = len(fixed) == array.ndim and all(d is None or d == s for d, s in zip(fixed, array.shape, strict=True))
        if _ORT_TYPES.get(str(array.dtype)) != want.type or not fits:
            raise ArtifactError(
                f"{folder}: case.npz's '{name}' is {array.dtype}{list(array.shape)}, region.onnx takes {want.type}"
                f"{want.shape}"
            )
    gives = {o.name for o in session.get_outputs()}
    missing = [v for v in bundle.expected if v not in gives]
    if missing:
        raise ArtifactError(f"{folder}: region.onnx computes no '{missing[0]}'")


def replay_bundle(folder: Path, provider: str = "cpu", max_memory: int | None = None) -> ReplayResult:
    """Run the bundle's ``region.onnx`` on its inputs with graph optimizations off, as
    localize ran it, and judge it as localize did: at the bundle's tolerance, in PyTorch's dtype,
    with PyTorch's values on the padded rows the spec leaves out."""
    budget = memory_budget(max_memory)
    bundle = read_bundle(folder, budget)
    session = load_session(bundle.model, provider, level="disabled", budget=budget, probe=True)
    _check_fit(folder, session, bundle)
    ((value, expected),) = bundle.expected.items()
    try:
        got = session.run([value], bundle.inputs)[0]
    except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own classes
        raise RuntimeFailure(f"onnxruntime[{provider}]: {first_line(e)}") from e
    tol = Tolerance(**{k: bundle.info["tolerance"].get(k, 0.0) for k in TOLERANCE_KEYS}, allow_nan=True)
    expected = representable(expected, got.dtype)  # as localize judged it
    comparison = judge_value(value, expected, left_out(expected, got, left_out_rows(bundle.info)), tol)
    return ReplayResult(str(folder), bundle.info, provider, comparison)
