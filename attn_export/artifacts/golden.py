"""Golden vector files: PyTorch's outputs at fixed shapes, so ``verify --golden`` needs no torch.

Keys in the .npz: ``<case>/sizes/<dim>`` (int64 scalars), ``<case>/inputs/<name>``,
``<case>/outputs/<name>``, ``<case>/floors/<name>`` (float64 scalars: PyTorch's own
float32 error on the case), ``<case>/int8/<name>`` (three float64: the rms and the largest
element of what the int8 rounding does to the module there, and how far near ties of int4's
move it, ``model_spec.Rounding``), ``<case>/simulated/int4:<name>`` (the module's output
with int4's rounding, ``Rounding.values``: a CPU's int4 graph is judged against it),
``<case>/unsimulated/<name>`` (where that rounding could not run: why, one line of UTF-8
as uint8, ``Rounding.unsimulated``) and
``<case>/sight/<mask>`` (two int64, -1 for "all": what a query sees under each
self-attention key-padding mask, ``GoldenCase.sights``); written with fixed timestamps and
sorted entries (deterministic).

A golden file may come from anywhere, so it is read from its zip directory and .npy
headers first: every entry's declared size, dtype and shape (against the spec, at the
case's sizes) and the total against the memory budget are checked before any array is
loaded. A 1 MB zip bomb declaring gigabytes costs nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from attn_export.artifacts.files import atomic_write, open_regular
from attn_export.errors import ArtifactError, InputError, first_line
from attn_export.model_spec import ModelSpec, Rounding
from attn_export.model_spec.cache import output_shape
from attn_export.model_spec.memory import check_memory, format_bytes, memory_budget
from attn_export.model_spec.shapes import ShapePoint, validate_sizes

__all__ = [
    "GOLDEN_FORMAT",
    "SECTIONS",
    "GoldenCase",
    "Sight",
    "checked_header",
    "encode_golden",
    "encode_npz",
    "load_entry",
    "open_npz",
    "npy_header",
    "read_golden",
    "read_sights",
    "write_golden",
]

#: What a case's entries hold (``<case>/<section>/<name>``).
SECTIONS = ("sizes", "inputs", "outputs", "floors", "int8", "simulated", "unsimulated", "sight")
#: What a golden file records; part of every build's key, so that a build folder written
#: before a change of it is rebuilt, not judged by what its golden files lack.
GOLDEN_FORMAT = 7
#: Bytes of one ``unsimulated`` reason: an exception's first line, cut at this when written.
_MAX_REASON = 1000


@dataclass(frozen=True)
class Sight:
    """How many positions before and after its own a query of the module sees (None: all
    of them), with every token kept (``checks.causality``). It decides which padded rows
    see no key."""

    before: int | None
    after: int | None

    def to_array(self) -> np.ndarray:
        return np.asarray([-1 if v is None else v for v in (self.before, self.after)], dtype=np.int64)

    @classmethod
    def from_array(cls, value: np.ndarray) -> Sight:
        before, after = (None if v == -1 else int(v) for v in value)
        return cls(before, after)


@dataclass
class GoldenCase:
    """One recorded case: the sizes, the feeds and PyTorch's outputs."""

    label: str
    sizes: dict[str, int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    #: Per output, PyTorch's own float32 error against float64 on these inputs.
    floors: dict[str, float] = field(default_factory=dict)
    #: Per output, how far the module strays under the int8 variant's rounding on these inputs.
    int8: dict[str, Rounding] = field(default_factory=dict)
    #: The positions a query of the module sees, per self-attention key-padding mask.
    sights: dict[str, Sight] = field(default_factory=dict)

    def sight(self, mask: str) -> Sight:
        """What a query sees under ``mask``; where the case records nothing, every
        position: only a sequence with no real token then counts as seeing no key, so no
        row that might see one is left out."""
        return self.sights.get(mask, Sight(None, None))


def encode_npz(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as a deterministic .npz (fixed timestamps, sorted entries), never pickled."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.asarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, npy.getvalue())
    return buf.getvalue()


def encode_golden(cases: list[GoldenCase]) -> bytes:
    """``cases`` as a deterministic .npz (``encode_npz``)."""
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
        for k, r in case.int8.items():
            arrays[f"{case.label}/int8/{k}"] = np.asarray([r.rms, r.max, r.ties], dtype=np.float64)
            if r.values is not None:
                arrays[f"{case.label}/simulated/{k}"] = r.values
            if r.unsimulated:
                line = "".join(c if c.isprintable() else " " for c in r.unsimulated)  # as read back: one line
                reason = line.encode("utf-8")[:_MAX_REASON].decode("utf-8", "ignore")
                arrays[f"{case.label}/unsimulated/{k}"] = np.frombuffer(reason.encode("utf-8"), np.uint8)
        for k, seen in case.sights.items():
            arrays[f"{case.label}/sight/{k}"] = seen.to_array()
    return encode_npz(arrays)


def write_golden(path: Path, cases: list[GoldenCase]) -> None:
    atomic_write(path, encode_golden(cases))


@dataclass
class _Entry:
    """One array in the zip, known from its headers only."""

    info: zipfile.ZipInfo
    label: str
    section: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def where(self) -> str:
        return f"case '{self.label}' {self.section[:-1]} '{self.name}'"


@contextlib.contextmanager
def open_npz(path: Path, root: Path | None, what: str) -> Iterator[zipfile.ZipFile]:
    """``path``, a regular file (inside ``root`` where given), open as the zip archive every
    .npz is; ArtifactError saying it is not ``what`` otherwise."""
    with open_regular(path, root) as (f, _):
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: not {what} (not a zip archive)") from exc
        with zf:
            yield zf


def npy_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype, int]:
    """An .npy entry's shape, dtype and header length, read without loading its data."""
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f".npy format version {version} is not supported")
        return tuple(int(d) for d in shape), dtype, f.tell()


def checked_header(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """An .npy entry's shape and dtype from its header, refused unless it holds plain
    numbers or bools and its declared size is exactly the entry's: nothing is loaded."""
    key = info.filename.removesuffix(".npy")
    try:
        shape, dtype, header_bytes = npy_header(zf, info)
    except Exception as e:  # numpy and zipfile raise many types on hostile bytes
        raise ArtifactError(f"{path}: entry '{key}' is not a readable .npy array ({first_line(e)})") from e
    if dtype.hasobject or dtype.kind not in "biuf":
        raise ArtifactError(f"{path}: entry '{key}' has dtype {dtype}, not a plain number or bool")
    if min(shape, default=0) < 0 or header_bytes + math.prod(shape) * dtype.itemsize != info.file_size:
        raise ArtifactError(
            f"{path}: entry '{key}' declares shape {shape} of {dtype}, which does not fit its {info.file_size} bytes"
        )
    return shape, dtype


def _entry(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Entry:
    key = info.filename.removesuffix(".npy")
    parts = key.split("/")
    if key == info.filename or len(parts) != 3 or parts[1] not in SECTIONS:
        raise ArtifactError(f"{path}: unexpected entry '{key}' in golden file")
    shape, dtype = checked_header(path, zf, info)
    return _Entry(info, parts[0], parts[1], parts[2], shape, dtype)


def load_entry(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """An .npy entry's array, never unpickled; an unreadable one is an ArtifactError."""
    try:
        with zf.open(info) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except Exception as exc:
        raise ArtifactError(f"{path}: entry '{info.filename}' cannot be read ({first_line(exc)})") from exc


def _check_case(path: Path, spec: ModelSpec, case: GoldenCase, entries: list[_Entry], budget: int) -> None:
    """Names, dtypes, sizes and shapes as the spec says, and a case that fits the budget."""
    try:
        validate_sizes(spec, case.sizes)
    except InputError as exc:
        raise ArtifactError(f"{path}: case '{case.label}': {exc}") from exc
    check_memory(spec, [ShapePoint(case.label, case.sizes)], budget)
    masks = {t.name for t, _ in spec.masks}
    unknown = sorted(e.name for e in entries if e.section == "sight" and e.name not in masks)
    if unknown:
        raise ArtifactError(f"{path}: case '{case.label}' records a sight under {unknown}, no mask of the spec")
    for section, tensors in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        got = {e.name: e for e in entries if e.section == section}
        names = sorted(t.name for t in tensors)
        if sorted(got) != names:
            raise ArtifactError(f"{path}: case '{case.label}' has {section} {sorted(got)}, expected {names}")
        for t in tensors:
            e = got[t.name]
            if e.dtype != np.dtype(t.dtype):
                raise ArtifactError(f"{path}: {e.where} has dtype {e.dtype}, expected {t.dtype}")
            want = output_shape(spec, t, case.sizes)
            if e.shape != want:
                raise ArtifactError(f"{path}: {e.where} has shape {list(e.shape)}, expected {list(want)}")


def _read(
    path: Path, f: IO[bytes], spec: ModelSpec | None, budget: int, sections: tuple[str, ...] = SECTIONS
) -> list[GoldenCase]:
    """The file's cases, the entries of ``sections`` read and those of the other sections
    never (an entry of no section is refused as ever); none where no entry is left to read
    and not every section is asked for."""
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not a golden file (not a zip archive, as every .npz is)") from exc
    with zf:
        infos = zf.infolist()
        if sections != SECTIONS:
            skipped = set(SECTIONS) - set(sections)
            infos = [i for i in infos if i.filename.partition("/")[2].partition("/")[0] not in skipped]
            if not infos:
                return []
        return read_cases(path, zf, infos, spec, budget)


def read_cases(
    path: Path, zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo], spec: ModelSpec | None, budget: int
) -> list[GoldenCase]:
    """The golden cases held by ``infos`` of an open zip, each checked as ``read_golden``
    says; a file that holds other things beside them (intermediates) reads them itself."""
    entries = [_entry(path, zf, info) for info in infos]
    keys = [(e.label, e.section, e.name) for e in entries]
    if len(set(keys)) != len(keys):
        raise ArtifactError(f"{path}: golden file holds an entry twice")
    declared = sum(e.info.file_size for e in entries)
    if declared > budget:
        raise ArtifactError(
            f"{path}: golden arrays declare {format_bytes(declared)}, over the memory budget of {format_bytes(budget)}"
        )
    cases: dict[str, GoldenCase] = {}
    for e in entries:
        case = cases.setdefault(e.label, GoldenCase(e.label, {}))
        if e.section == "sizes":
            if e.shape != () or e.dtype.kind not in "iu":
                raise ArtifactError(f"{path}: size entry '{e.label}/sizes/{e.name}' is not an integer scalar")
            case.sizes[e.name] = int(load_entry(path, zf, e.info))
    if not cases:
        raise ArtifactError(f"{path}: golden file holds no cases")
    if spec is not None:
        for case in cases.values():
            _check_case(path, spec, case, [e for e in entries if e.label == case.label], budget)
    reasons: list[_Entry] = []
    for e in entries:  # a floor's, a rounding's and a sight's shape and dtype are checked before they are loaded
        if e.section == "floors":
            value = load_entry(path, zf, e.info) if e.shape == () and e.dtype == np.float64 else None
            if value is None or not np.isfinite(value) or value < 0:
                raise ArtifactError(
                    f"{path}: floor entry '{e.label}/floors/{e.name}' is not a finite non-negative float64 scalar"
                )
            cases[e.label].floors[e.name] = float(value)
        elif e.section == "int8":
            if e.shape == (2,) and e.dtype == np.float64:
                raise ArtifactError(
                    f"{path}: entry '{e.label}/int8/{e.name}' records no int4 ties: an older attn-export wrote "
                    "this golden file; rebuild it with attn-export build"
                )
            value = load_entry(path, zf, e.info) if e.shape == (3,) and e.dtype == np.float64 else None
            if value is None or not np.isfinite(value).all() or value.min() < 0:
                raise ArtifactError(
                    f"{path}: entry '{e.label}/int8/{e.name}' is not a rounding: three finite non-negative float64"
                )
            cases[e.label].int8[e.name] = Rounding(float(value[0]), float(value[1]), float(value[2]), recorded=True)
        elif e.section in ("unsimulated", "simulated"):
            reasons.append(e)  # once every rounding is read
        elif e.section == "sight":
            value = load_entry(path, zf, e.info) if e.shape == (2,) and e.dtype.kind in "iu" else None
            if value is None or value.min() < -1:
                raise ArtifactError(f"{path}: entry '{e.label}/sight/{e.name}' is not a sight: two ints of -1 or more")
            cases[e.label].sights[e.name] = Sight.from_array(value)
        elif e.section != "sizes":
            section = cases[e.label].inputs if e.section == "inputs" else cases[e.label].outputs
            section[e.name] = load_entry(path, zf, e.info)
    for e in reasons:
        if e.name not in cases[e.label].int8:
            where = f"{e.label}/{e.section}/{e.name}"
            raise ArtifactError(f"{path}: entry '{where}' belongs to no rounding the case records")
        found = cases[e.label].int8[e.name]
        if e.section == "unsimulated":
            cases[e.label].int8[e.name] = dataclasses.replace(found, unsimulated=_reason(path, zf, e))
        else:
            cases[e.label].int8[e.name] = dataclasses.replace(found, values=_simulated(path, zf, e, cases[e.label]))
    for t in spec.inputs if spec is not None else ():  # inputs verify could have fed
        for case in cases.values():
            stray = t.stray_nonfinite(case.inputs[t.name]) if t.name in case.inputs else None
            if stray:
                raise ArtifactError(f"{path}: case '{case.label}': {stray}")
    return list(cases.values())


def _simulated(path: Path, zf: zipfile.ZipFile, e: _Entry, case: GoldenCase) -> np.ndarray:
    """int4's simulated output: float, of the recorded output's shape and dtype."""
    rounding, _, output = e.name.partition(":")
    recorded = case.outputs.get(output)
    if rounding != "int4" or recorded is None or recorded.dtype.kind != "f":
        raise ArtifactError(f"{path}: entry '{e.label}/simulated/{e.name}' names no float output as int4:<output>")
    if e.shape != recorded.shape or e.dtype != recorded.dtype:
        raise ArtifactError(
            f"{path}: entry '{e.label}/simulated/{e.name}' has shape {list(e.shape)} of {e.dtype}, "
            f"expected {list(recorded.shape)} of {recorded.dtype} as its output"
        )
    values = load_entry(path, zf, e.info)
    if not np.isfinite(values[np.isfinite(recorded)]).all():
        raise ArtifactError(
            f"{path}: entry '{e.label}/simulated/{e.name}' is not finite where its output is: not a simulation"
        )
    return values


def _reason(path: Path, zf: zipfile.ZipFile, e: _Entry) -> str:
    """Why a rounding could not run: one line of UTF-8, at most ``_MAX_REASON`` bytes."""
    fits = e.shape[0] <= _MAX_REASON if e.dtype == np.uint8 and len(e.shape) == 1 else False
    text = None
    if fits:
        try:
            text = load_entry(path, zf, e.info).tobytes().decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if not text or not text.isprintable():
        raise ArtifactError(
            f"{path}: entry '{e.label}/unsimulated/{e.name}' is not a reason: one line of UTF-8 text as uint8, "
            f"at most {_MAX_REASON} bytes"
        )
    return text


def read_golden(
    path: Path,
    spec: ModelSpec | None = None,
    budget: int | None = None,
    root: Path | None = None,
    sections: tuple[str, ...] = SECTIONS,
) -> list[GoldenCase]:
    """Read golden vectors back, checking every header first (see the module's docstring);
    with ``spec``, each array must have the spec's dtype and shape at its case's sizes.
    ``budget`` defaults to the caller's (``memory_budget``); ``root`` is the folder the file must stay in;
    only the entries of ``sections`` are read. A malformed file is an ArtifactError, never a crash."""
    if not path.exists() and not path.is_symlink():
        raise ArtifactError(f"{path}: golden file is missing")
    with open_regular(path, root) as (f, _):
        return _read(path, f, spec, budget or memory_budget(), sections)


def read_sights(path: Path, spec: ModelSpec, budget: int | None = None, root: Path | None = None) -> dict[str, Sight]:
    """What a query sees under each of the spec's masks, as a build's golden file records it
    (each of its cases records the same), read alone: golden mode judges the user's recorded
    inputs by it, as it judges the build's own cases. Empty where none is recorded."""
    cases = read_golden(path, budget=budget, root=root, sections=("sight",))
    masks = {t.name for t, _ in spec.masks}
    found: dict[str, Sight] = {}
    for case in cases:
        unknown = sorted(set(case.sights) - masks)
        if unknown:
            raise ArtifactError(f"{path}: case '{case.label}' records a sight under {unknown}, no mask of the spec")
        for mask, seen in case.sights.items():
            if found.setdefault(mask, seen) != seen:
                raise ArtifactError(f"{path}: its cases record different sights under mask '{mask}'")
    return found
