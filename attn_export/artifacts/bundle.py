"""A replay bundle: the smallest graph that shows a divergence, as files anyone can rerun.

``region.onnx`` (the blamed region's nodes alone), ``case.npz`` (the inputs it was fed,
PyTorch's values, and PyTorch's value of its result, in the golden files' layout),
``bundle.json`` (what it is, where it came from, the tolerance, the padded rows left
out) and ``reproduce.sh``
(``attn-export replay`` on the folder: no torch, no build folder, no checkout needed).
A bundle is data: reading one runs nothing it names and reads no more than the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.artifacts.files import atomic_write, read_regular, resolved, schema_document
from attn_export.artifacts.golden import GoldenCase, encode_golden, read_golden
from attn_export.artifacts.json_text import json_text
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.errors import ArtifactError, OptionError

__all__ = [
    "BUNDLE_SCHEMA",
    "TOLERANCE_KEYS",
    "Bundle",
    "check_bundle_folder",
    "left_out_rows",
    "read_bundle",
    "write_bundle",
]

BUNDLE_SCHEMA = "attn-export/replay-bundle"
BUNDLE_VERSION = 1
_CASE = "replay"
#: The tolerance ``bundle.json`` records, each a finite number >= 0: atol and rtol, and
#: the shares of the value's rms (``model_spec.Tolerance``; 0 where a bundle leaves them out).
TOLERANCE_KEYS = ("atol", "rtol", "atol_rms", "rms_rtol")


@dataclass
class Bundle:
    """A bundle read back: what ``bundle.json`` says, the region's graph, its inputs and
    PyTorch's value of its result."""

    info: dict[str, Any]
    model: bytes
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]


def _comment(text: str) -> str:
    """``text`` as one shell comment line: a line break in a name cannot end the comment."""
    return "# " + " ".join(text.split()) + "\n"


def _script(info: dict[str, Any]) -> str:
    where = f"{info['model']}: the region of FX node {info['fx_node']} ({', '.join(info['nodes'][:3])})"
    return (
        "#!/bin/sh\n"
        + _comment(f"{where} at {info['source'] or 'no source line'}")
        + _comment(f"found by: {info['localize']}")
        + _comment("Exits 0 when the region gives PyTorch's value, 1 when it does not.")
        + 'exec attn-export replay "$(dirname "$0")" "$@"\n'
    )


def check_bundle_folder(folder: Path) -> None:
    """Refuse, before any work, a bundle folder that is not new or empty (nothing is
    replaced) or that lies past a loop of symbolic links (it could not be made)."""
    resolved(folder)
    if folder.is_symlink() or (folder.exists() and (not folder.is_dir() or any(folder.iterdir()))):
        raise OptionError(
            "{bundle} {value}: give a new or empty folder (nothing in it is replaced)", ["bundle"], value=folder
        )


def write_bundle(
    folder: Path, model: bytes, inputs: dict[str, np.ndarray], expected: dict[str, np.ndarray], info: dict[str, Any]
) -> None:
    """Write a bundle into ``folder``, which must be new or empty (nothing is replaced)."""
    check_bundle_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OptionError(
            "{bundle} {value}: cannot make it: {why}", ["bundle"], value=folder, why=e.strerror or e
        ) from e
    info = {"schema": BUNDLE_SCHEMA, "schema_version": BUNDLE_VERSION, **info}
    case = GoldenCase(_CASE, {}, inputs, expected)
    atomic_write(folder / "region.onnx", model)
    atomic_write(folder / "case.npz", encode_golden([case]))
    atomic_write(folder / "bundle.json", json_text(info).encode())
    atomic_write(folder / "reproduce.sh", _script(info).encode())
    (folder / "reproduce.sh").chmod(0o755)


def read_bundle(folder: Path, budget: int) -> Bundle:
    """A bundle's files, each read as data within its bound (``budget`` for the arrays)."""
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: not a replay bundle folder")
    path = folder / "bundle.json"
    try:
        text = read_regular(path, folder, 1 << 20).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON (not UTF-8)") from e
    info = schema_document(
        text, str(path), BUNDLE_SCHEMA, BUNDLE_VERSION, "replay bundle", "localize again with --bundle"
    )
    _check_info(path, info)
    model = load_model_file(folder / "region.onnx", with_data=True, budget=budget).SerializeToString()
    cases = read_golden(folder / "case.npz", budget=budget, root=folder)
    if [c.label for c in cases] != [_CASE] or sorted(cases[0].outputs) != [info["value"]]:
        raise ArtifactError(
            f"{folder / 'case.npz'}: holds no '{_CASE}' case with inputs and PyTorch's value of '{info['value']}' alone"
        )
    return Bundle(info, model, cases[0].inputs, cases[0].outputs)


def _finite(value: object) -> bool:
    """A number >= 0 that a float holds (an int past 1e308 overflowed in the comparison)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return 0 <= float(value) < float("inf")
    except OverflowError:
        return False


def _check_info(path: Path, info: dict[str, Any]) -> None:
    """What replay reads from ``bundle.json``: names as strings, a finite tolerance >= 0."""
    for key in ("model", "fx_node", "value", "source", "code", "localize"):
        if not isinstance(info.get(key), str):
            raise ArtifactError(f"{path}: '{key}' must be a string")
    nodes = info.get("nodes")
    if not (isinstance(nodes, list) and nodes and all(isinstance(n, str) for n in nodes)):
        raise ArtifactError(f"{path}: 'nodes' must be a list of node names")
    tol = info.get("tolerance")
    ok = isinstance(tol, dict) and all(
        _finite(tol.get(k, 0.0 if k in TOLERANCE_KEYS[2:] else None)) for k in TOLERANCE_KEYS
    )
    if not ok:
        raise ArtifactError(f"{path}: 'tolerance' must hold a finite atol and rtol >= 0 (and atol_rms, rms_rtol)")
    rows = info.get("left_out_rows")
    if rows is not None and not (
        isinstance(rows, list)
        and rows
        and all(isinstance(r, list) and len(r) == len(rows[0]) and all(isinstance(x, bool) for x in r) for r in rows)
    ):
        raise ArtifactError(f"{path}: 'left_out_rows' must be null or a [batch, query] list of lists of true/false")


def left_out_rows(info: dict[str, Any]) -> np.ndarray | None:
    """The padded query rows ``[batch, query]`` a bundle's value is not judged on (the spec
    leaves them out, ``fully_masked = "ignore"``), as ``bundle.json`` records them."""
    rows = info.get("left_out_rows")
    return None if rows is None else np.array(rows, dtype=bool)
