"""Artifacts on disk: atomic writes, hashes, the build lock, and golden vector files.

Every file is written to a temporary sibling, flushed and renamed into place, so an
interrupted build never leaves a truncated file: the old one stays until the new is whole.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from attn_export.errors import ArtifactError, LockError, UsageError

__all__ = [
    "atomic_write",
    "build_lock",
    "read_golden",
    "sha256_bytes",
    "sha256_file",
    "write_golden",
]

LOCK_NAME = ".attn-export.lock"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: file listed in the manifest is missing") from e
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror}") from e
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    fd = -1
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = ""
    except OSError as e:
        reason = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise UsageError(f"cannot write {path}: {reason}") from e
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def build_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` so two builds never interleave their writes."""
    import fcntl

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        handle = (out_dir / LOCK_NAME).open("a")
    except OSError as e:
        raise UsageError(f"cannot use output directory {out_dir}: {e.strerror}") from e
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise LockError(f"{out_dir} is locked by another attn-export build; try again when it ends") from e
        yield
    finally:
        handle.close()


def write_golden(
    path: Path, cases: list[tuple[str, Mapping[str, int], dict[str, np.ndarray], dict[str, np.ndarray]]]
) -> None:
    """Write golden vectors as a deterministic .npz: fixed timestamps, sorted entries.

    Keys: ``<case>/sizes/<dim>``, ``<case>/inputs/<name>``, ``<case>/outputs/<name>``.
    """
    arrays: dict[str, np.ndarray] = {}
    for label, sizes, feeds, outputs in cases:
        for k, v in sizes.items():
            arrays[f"{label}/sizes/{k}"] = np.asarray(v, dtype=np.int64)
        for k, v in feeds.items():
            arrays[f"{label}/inputs/{k}"] = v
        for k, v in outputs.items():
            arrays[f"{label}/outputs/{k}"] = v
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.asarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, npy.getvalue())
    atomic_write(path, buf.getvalue())


GoldenCase = tuple[str, dict[str, int], dict[str, np.ndarray], dict[str, np.ndarray]]


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
        if len(parts) != 3 or parts[1] not in ("sizes", "inputs", "outputs"):
            raise ArtifactError(f"{path}: unexpected entry '{key}' in golden file")
        label, section, name = parts
        case = cases.setdefault(label, (label, {}, {}, {}))
        if section == "sizes":
            if value.shape != () or value.dtype.kind not in "iu":
                raise ArtifactError(f"{path}: size entry '{key}' is not an integer scalar")
            case[1][name] = int(value)
        else:
            case[2 if section == "inputs" else 3][name] = value
    if not cases:
        raise ArtifactError(f"{path}: golden file holds no cases")
    return list(cases.values())
