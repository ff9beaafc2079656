"""Recorded intermediates: PyTorch's value of every FX node on one golden case, so that
``localize --golden`` finds where a graph leaves PyTorch on a box without torch.

The file (``<model>.intermediates.npz``) is a zip, written deterministically like a golden
file: the case in the golden file's layout (``<case>/sizes|inputs|outputs|floors|facts/<name>``),
``values/<fx node>.npy`` for each FX node's tensor, and ``meta.json`` naming the case, the
FX node that gives each output and each node's aten op and source line, and for an int4
graph whose values are its simulation's (``int4``), how many matmuls it rounded and how far
each value moves with near ties. It may come from
anywhere, so it is read like a golden file: every header and the total against the memory
budget before any array is loaded, the case against the spec, names against a strict
pattern, and ``meta.json`` against its schema.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attn_export.artifacts.files import schema_document
from attn_export.artifacts.golden import GoldenCase, checked_header, encode_golden, load_entry, open_npz, read_cases
from attn_export.artifacts.json_text import json_text
from attn_export.errors import ArtifactError, first_line
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.memory import format_bytes

__all__ = ["Intermediates", "encode_intermediates", "read_intermediates"]

SCHEMA = "attn-export/intermediates"
SCHEMA_VERSION = 1
_META = "meta.json"
#: The names, aten ops and source lines of a few thousand FX nodes; anything near this is not one.
_MAX_META_BYTES = 4 << 20
#: FX node names are Python identifiers (``aten_mul_3``, ``scaled_dot_product_attention``).
_NODE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")


@dataclass
class Intermediates:
    """One case and PyTorch's value of every FX node on it."""

    case: GoldenCase
    #: PyTorch's value of each FX node that gives a tensor, by node name.
    values: dict[str, np.ndarray] = field(default_factory=dict)
    #: Which FX node gives each graph output.
    outputs: dict[str, str] = field(default_factory=dict)
    #: Each FX node's aten op, ``file.py:line`` and the line's text.
    sources: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    #: How many matmuls the values rounded as int4's simulation does (0: the float module's).
    int4_rounded: int = 0
    #: How far each value moves with int4's near ties (``localize.values.simulated_values``).
    ties: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values.values())


def encode_intermediates(rec: Intermediates) -> bytes:
    """``rec`` as a deterministic zip (fixed timestamps, sorted entries)."""
    meta = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "case": rec.case.label,
        "outputs": rec.outputs,
        "sources": {k: list(v) for k, v in rec.sources.items()},
    }
    if rec.int4_rounded:
        meta["int4"] = {"rounded": rec.int4_rounded, "ties": rec.ties}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zipfile.ZipFile(io.BytesIO(encode_golden([rec.case]))) as golden:
            arrays = {info.filename: golden.read(info) for info in golden.infolist()}
        for name, value in rec.values.items():
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(value), allow_pickle=False)
            arrays[f"values/{name}.npy"] = npy.getvalue()
        arrays[_META] = json_text(meta, indent=1, sort_keys=True, end="").encode()
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, arrays[key])
    return buf.getvalue()


def _meta(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo | None) -> dict[str, object]:
    if info is None:
        raise ArtifactError(f"{path}: not an intermediates file (no {_META})")
    if info.file_size > _MAX_META_BYTES:
        raise ArtifactError(f"{path}: {_META} declares {format_bytes(info.file_size)}; refused")
    try:
        text = zf.read(info)[:_MAX_META_BYTES].decode("utf-8")
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"{path}: {_META} is not readable ({first_line(e)})") from e
    rebuild = "rebuild with this version (attn-export build --record-intermediates --force)"
    return schema_document(text, f"{path}: {_META}", SCHEMA, SCHEMA_VERSION, "intermediates file", rebuild)


def _strings(path: Path, doc: dict[str, object], key: str, width: int) -> dict[str, list[str]]:
    """``doc[key]``: an object from FX node names to ``width`` strings (1: a bare string)."""
    value = doc.get(key)
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: {_META} '{key}' is not an object")
    out = {}
    for k, v in value.items():
        items = [v] if width == 1 else v
        if not (isinstance(items, list) and len(items) == width and all(isinstance(s, str) for s in items)):
            raise ArtifactError(f"{path}: {_META} '{key}' entry {k!r} is not {width} string(s)")
        out[k] = items
    return out


def read_intermediates(path: Path, spec: ModelSpec, budget: int, root: Path | None = None) -> Intermediates:
    """Read an intermediates file back, checking it as the module's docstring says; a
    malformed one is an ArtifactError, never a crash."""
    if not path.exists() and not path.is_symlink():
        raise ArtifactError(f"{path}: intermediates file is missing")
    with open_npz(path, root, "an intermediates file") as zf:
        infos = zf.infolist()
        doc = _meta(path, zf, next((i for i in infos if i.filename == _META), None))
        values = [i for i in infos if i.filename.startswith("values/")]
        golden = [i for i in infos if i.filename != _META and not i.filename.startswith("values/")]
        shapes = {}
        for info in values:
            name = info.filename.removeprefix("values/").removesuffix(".npy")
            if not _NODE.fullmatch(name) or info.filename != f"values/{name}.npy":
                raise ArtifactError(f"{path}: unexpected entry '{info.filename}' in intermediates file")
            shapes[name] = checked_header(path, zf, info)
        declared = sum(i.file_size for i in values)
        if len(shapes) != len(values) or declared > budget:
            if len(shapes) != len(values):
                raise ArtifactError(f"{path}: intermediates file holds a value twice")
            raise ArtifactError(
                f"{path}: intermediate values declare {format_bytes(declared)}, over the memory budget of "
                f"{format_bytes(budget)}"
            )
        cases = read_cases(path, zf, golden, spec, budget - declared)
        if len(cases) != 1 or cases[0].label != doc.get("case"):
            raise ArtifactError(f"{path}: holds cases {[c.label for c in cases]}, not the one {_META} names")
        outputs = {k: v[0] for k, v in _strings(path, doc, "outputs", 1).items()}
        sources = {k: (v[0], v[1], v[2]) for k, v in _strings(path, doc, "sources", 3).items()}
        if sorted(outputs) != sorted(t.name for t in spec.outputs):
            raise ArtifactError(f"{path}: {_META} maps outputs {sorted(outputs)}, not the spec's")
        rec = Intermediates(cases[0], {}, outputs, sources)
        for info in values:
            rec.values[info.filename.removeprefix("values/").removesuffix(".npy")] = load_entry(path, zf, info)
        rec.int4_rounded, rec.ties = _int4(path, doc, rec.values)
    return rec


def _int4(path: Path, doc: dict[str, object], values: dict[str, np.ndarray]) -> tuple[int, dict[str, float]]:
    """``meta.json``'s ``int4``: how many matmuls were rounded and each value's ties, each a
    finite distance no wider than twice the value's largest magnitude (data: a wider room
    would excuse any region); (0, {}) where the values are the float module's."""
    raw = doc.get("int4")
    if raw is None:
        return 0, {}
    rounded = raw.get("rounded") if isinstance(raw, dict) else None
    ties = raw.get("ties") if isinstance(raw, dict) else None
    if not (isinstance(rounded, int) and not isinstance(rounded, bool) and rounded > 0 and isinstance(ties, dict)):
        raise ArtifactError(f"{path}: {_META} 'int4' is not {{'rounded': a positive count, 'ties': an object}}")
    out = {}
    for name, tie in ties.items():
        value = values.get(name)
        top = (
            float(np.abs(value[np.isfinite(value)]).max(initial=0.0))
            if value is not None and value.dtype.kind == "f"
            else 0.0
        )
        if isinstance(tie, bool) or not isinstance(tie, int | float) or not 0 <= tie <= 2 * top:
            raise ArtifactError(
                f"{path}: {_META} 'int4' ties of {name!r} is {tie!r}, not a distance its value can move"
            )
        out[name] = float(tie)
    return rounded, out
