"""Golden vector files: PyTorch's outputs at fixed shapes, so ``verify --golden`` needs no torch.

Keys in the .npz: ``<case>/sizes/<dim>`` (int64 scalars), ``<case>/inputs/<name>``,
``<case>/outputs/<name>`` and ``<case>/floors/<name>`` (float64 scalars: PyTorch's own
float32 error on the case); written with fixed timestamps and sorted entries (deterministic).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attn_export.artifacts.files import atomic_write
from attn_export.errors import ArtifactError

__all__ = ["GoldenCase", "read_golden", "write_golden"]


@dataclass
class GoldenCase:
    """One recorded case: the sizes, the feeds and PyTorch's outputs."""

    label: str
    sizes: dict[str, int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    #: Per output, PyTorch's own float32 error against float64 on these inputs.
    floors: dict[str, float] = field(default_factory=dict)


def write_golden(path: Path, cases: list[GoldenCase]) -> None:
    """Write ``cases`` as a deterministic .npz (fixed timestamps, sorted entries)."""
    arrays: dict[str, np.ndarray] = {}
    for case in cases:
        for k, v in case.sizes.items():
            arrays[f"{case.label}/sizes/{k}"] = np.asarray(v, dtype=np.int64)
        for k, a in case.inputs.items():
            arrays[f"{case.label}/inputs/{k}"] = a
        for k, a in case.outputs.items():
            arrays[f"{case.label}/outputs/{k}"] = a
        for k, f in case.floors.items():
            arrays[f"{case.label}/floors/{k}"] = np.asarray(f, dtype=np.float64)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.asarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, npy.getvalue())
    atomic_write(path, buf.getvalue())


def read_golden(path: Path) -> list[GoldenCase]:
    """Read golden vectors back; a malformed file is an ArtifactError, never a crash."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: golden file is missing") from e
    except Exception as e:
        raise ArtifactError(f"{path}: not a readable golden .npz ({type(e).__name__}: {e})") from e
    cases: dict[str, GoldenCase] = {}
    for key, value in arrays.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[1] not in ("sizes", "inputs", "outputs", "floors"):
            raise ArtifactError(f"{path}: unexpected entry '{key}' in golden file")
        label, section, name = parts
        case = cases.setdefault(label, GoldenCase(label, {}))
        if section == "sizes":
            if value.shape != () or value.dtype.kind not in "iu":
                raise ArtifactError(f"{path}: size entry '{key}' is not an integer scalar")
            case.sizes[name] = int(value)
        elif section == "floors":
            if value.shape != () or value.dtype != np.float64 or not np.isfinite(value) or value < 0:
                raise ArtifactError(f"{path}: floor entry '{key}' is not a finite non-negative float64 scalar")
            case.floors[name] = float(value)
        else:
            (case.inputs if section == "inputs" else case.outputs)[name] = value
    if not cases:
        raise ArtifactError(f"{path}: golden file holds no cases")
    return list(cases.values())
