"""Files on disk: bounded reads of regular files, atomic writes, hashes and the build lock.

Every file is written to a temporary sibling, flushed and renamed into place, so an
interrupted build never leaves a truncated file: the old one stays until the new is whole.
Every artifact is read only if it is a regular file (a FIFO or ``/dev/zero`` would hang or
never end), inside its folder when one is given, and no further than the size it claims.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from attn_export.errors import ArtifactError, LockError, UsageError

__all__ = [
    "LOCK_WAIT_S",
    "atomic_write",
    "build_lock",
    "open_regular",
    "read_regular",
    "sha256_bytes",
    "sha256_file",
]

LOCK_NAME = ".attn-export.lock"
#: How long a build waits for another build of the same folder: long enough for a CI job's
#: concurrent build to finish, short enough to fail a stuck one.
LOCK_WAIT_S = 300.0
_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def open_regular(path: Path, root: Path | None = None, limit: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """Open ``path`` for reading, with its size, if it is a regular file (after symlinks,
    which must stay inside ``root`` when given) of at most ``limit`` bytes."""
    if root is not None and not path.resolve().is_relative_to(root.resolve()):
        raise ArtifactError(f"{path}: refused: a symbolic link to a file outside {root}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: no such file") from e
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror}") from e
    info = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(info.st_mode):
        problem = "is a directory, not a file"
    elif not stat.S_ISREG(info.st_mode):
        problem = "refused: not a regular file (a device, FIFO or socket)"
    elif limit is not None and info.st_size > limit:
        problem = f"refused: {info.st_size} bytes, more than the {limit} allowed"
    if problem:
        os.close(fd)
        raise ArtifactError(f"{path}: {problem}")
    with os.fdopen(fd, "rb") as f:
        yield f, info.st_size


def read_regular(path: Path, root: Path | None = None, limit: int | None = None) -> bytes:
    """The bytes of a regular file (see ``open_regular``), never more than its size."""
    with open_regular(path, root, limit) as (f, size):
        try:
            return f.read(size)
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read: {e.strerror}") from e


def sha256_file(path: Path, root: Path | None = None) -> str:
    """Hash of a regular file the manifest lists (see ``open_regular``)."""
    if not os.path.lexists(path):
        raise ArtifactError(f"{path}: file listed in the manifest is missing")
    h = hashlib.sha256()
    try:
        with open_regular(path, root) as (f, size):
            while size > 0 and (chunk := f.read(min(_CHUNK, size))):
                h.update(chunk)
                size -= len(chunk)
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
def build_lock(out_dir: Path, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` so two builds never interleave their writes;
    wait up to ``wait_s`` seconds for another build to release it, telling ``on_wait`` once."""
    import fcntl

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        handle = (out_dir / LOCK_NAME).open("a")
    except OSError as e:
        raise UsageError(f"cannot use output directory {out_dir}: {e.strerror}") from e
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = f" after waiting {wait_s:g} s" if wait_s else ""
                    raise LockError(
                        f"{out_dir} is locked by another attn-export build{waited}; try again when it ends "
                        "(--wait SECONDS waits longer)"
                    ) from e
                if on_wait is not None:
                    on_wait(f"{out_dir} is locked by another attn-export build; waiting up to {wait_s:g} s")
                    on_wait = None
                time.sleep(min(0.1, left))
        yield
    finally:
        handle.close()
