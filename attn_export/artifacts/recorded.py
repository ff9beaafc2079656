"""A user's recorded inputs (real activations) for ``verify --inputs FILE.npz``.

Two layouts: ``<input name>`` keys hold one case; ``<case>/inputs/<name>`` keys (with
optional ``<case>/outputs/<name>``, the golden files' layout) hold one or many. Outputs
are needed only in golden mode, where no PyTorch runs to compute them.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from attn_export.artifacts.files import open_regular
from attn_export.artifacts.golden import SECTIONS, GoldenCase, npy_header, read_golden
from attn_export.errors import ArtifactError
from attn_export.model_spec.memory import format_bytes

__all__ = ["RECORDED", "read_recorded"]

#: The value distribution reported for recorded cases.
RECORDED = "recorded"


def read_recorded(path: Path, budget: int) -> list[GoldenCase]:
    """The recorded cases; sizes are left for the caller to read off the feeds. Only a
    regular file is read (a FIFO would block), and every array's header is checked against
    ``budget`` before any data is loaded (a small file can declare huge arrays)."""
    with open_regular(path) as (f, _):
        try:
            with zipfile.ZipFile(f) as zf:
                infos = zf.infolist()
                nested = any("/" in i.filename for i in infos)  # the golden files' layout
                flat = None if nested else _read_flat(path, zf, infos, budget)
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"{path}: not a readable .npz of inputs ({type(e).__name__})") from e
    if flat is not None:
        return [GoldenCase("recorded", {}, flat)]
    # what a query sees is the build's to say, or PyTorch's: never read from this file
    cases = read_golden(path, budget=budget, sections=tuple(s for s in SECTIONS if s != "sight"))
    for case in cases:
        if not case.inputs:
            raise ArtifactError(f"{path}: case '{case.label}' holds no inputs")
    return cases


def _read_flat(path: Path, zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo], budget: int) -> dict[str, np.ndarray]:
    if not infos:
        raise ArtifactError(f"{path}: holds no arrays")
    declared = 0
    for info in infos:
        shape, dtype, _ = npy_header(zf, info)
        if dtype.hasobject or dtype.kind not in "biuf" or min(shape, default=0) < 0:
            raise ArtifactError(f"{path}: entry '{info.filename}' is not an array of plain numbers")
        declared += math.prod(shape) * dtype.itemsize
    if declared > budget:
        raise ArtifactError(
            f"{path}: its arrays declare {format_bytes(declared)}, over the memory budget of {format_bytes(budget)}"
        )
    arrays = {}
    for info in infos:
        with zf.open(info) as member:
            arrays[info.filename.removesuffix(".npy")] = np.lib.format.read_array(member, allow_pickle=False)
    return arrays
