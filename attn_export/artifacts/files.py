"""Files on disk: atomic writes, hashes and the build lock.

Every file is written to a temporary sibling, flushed and renamed into place, so an
interrupted build never leaves a truncated file: the old one stays until the new is whole.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from attn_export.errors import ArtifactError, LockError, UsageError

__all__ = [
    "atomic_write",
    "build_lock",
    "sha256_bytes",
    "sha256_file",
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
