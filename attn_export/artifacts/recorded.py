"""A user's recorded inputs (real activations) for ``verify --inputs FILE.npz``.

Two layouts: ``<input name>`` keys hold one case; ``<case>/inputs/<name>`` keys (with
optional ``<case>/outputs/<name>``, the golden files' layout) hold one or many. Outputs
are needed only in golden mode, where no PyTorch runs to compute them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attn_export.artifacts.golden import GoldenCase, read_golden
from attn_export.errors import ArtifactError

__all__ = ["RECORDED", "read_recorded"]

#: The value distribution reported for recorded cases.
RECORDED = "recorded"


def read_recorded(path: Path) -> list[GoldenCase]:
    """The recorded cases; sizes are left for the caller to read off the feeds."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            flat = all("/" not in k for k in npz.files)
            arrays = {k: npz[k] for k in npz.files} if flat else None
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: no such inputs file") from e
    except Exception as e:
        raise ArtifactError(f"{path}: not a readable .npz of inputs ({type(e).__name__})") from e
    if arrays is not None:
        if not arrays:
            raise ArtifactError(f"{path}: holds no arrays")
        return [GoldenCase("recorded", {}, arrays)]
    cases = read_golden(path)
    for case in cases:
        if not case.inputs:
            raise ArtifactError(f"{path}: case '{case.label}' holds no inputs")
    return cases
