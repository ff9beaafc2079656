"""``attn-export replay``: rerun a bundle's region on its recorded inputs and compare with
PyTorch's recorded value; no torch, no build folder and no checkout, so it runs where a new
ONNX Runtime is deployed and in a bug report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.artifacts.bundle import TOLERANCE_KEYS, Bundle, left_out_rows, read_bundle
from attn_export.compare.outputs import OutputComparison, judge_value
from attn_export.errors import ArtifactError, RuntimeFailure, RunTimeout, first_line
from attn_export.model_spec import Tolerance
from attn_export.model_spec.memory import memory_budget
from attn_export.pipelines.localize.judge import judged_elements, left_out, representable
from attn_export.runtimes.ort import RUN_TIMEOUT_S, check_timeout, load_session, run_bounded

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


def _run(session: Any, value: str, bundle: Bundle, provider: str, timeout_s: float) -> np.ndarray:
    """The region's value, its run stopped after ``timeout_s`` seconds."""
    try:
        return run_bounded(session, [value], bundle.inputs, timeout_s)[0]
    except RunTimeout as e:
        raise RunTimeout(f"onnxruntime[{provider}]: the region {e}") from e
    except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own classes
        raise RuntimeFailure(f"onnxruntime[{provider}]: {first_line(e)}") from e


def replay_bundle(
    folder: Path, provider: str = "cpu", max_memory: int | None = None, timeout_s: float = RUN_TIMEOUT_S
) -> ReplayResult:
    """Run the bundle's ``region.onnx`` on its inputs with graph optimizations off, as
    localize ran it, for at most ``timeout_s`` seconds, and judge it as localize did: at the
    bundle's tolerance, in PyTorch's dtype, with PyTorch's values on the padded rows the
    spec leaves out. A bundle whose left-out rows leave nothing to judge is refused: it
    would agree having compared nothing. UsageError for a ``timeout_s`` that is not seconds
    above 0 and at most a day."""
    timeout_s = check_timeout(timeout_s)
    budget = memory_budget(max_memory)
    bundle = read_bundle(folder, budget)
    ((value, expected),) = bundle.expected.items()
    rows = left_out_rows(bundle.info)
    if not judged_elements(expected.shape, rows):
        raise ArtifactError(
            f"{folder / 'bundle.json'}: no element of '{value}' {list(expected.shape)} is left to compare once its "
            "left_out_rows are left out: a replay would agree having compared nothing"
        )
    session = load_session(bundle.model, provider, level="disabled", budget=budget, probe=True)
    _check_fit(folder, session, bundle)
    got = _run(session, value, bundle, provider, timeout_s)
    tol = Tolerance(**{k: bundle.info["tolerance"].get(k, 0.0) for k in TOLERANCE_KEYS}, allow_nan=True)
    expected = representable(expected, got.dtype)  # as localize judged it
    comparison = judge_value(value, expected, left_out(expected, got, rows), tol)
    return ReplayResult(str(folder), bundle.info, provider, comparison)
