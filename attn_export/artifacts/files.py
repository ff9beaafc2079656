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
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from attn_export.errors import ArtifactError, LockError, UsageError, first_line

__all__ = [
    "LOCK_NAME",
    "LOCK_WAIT_S",
    "STAGED",
    "append_output",
    "atomic_write",
    "build_lock",
    "open_regular",
    "output_target",
    "read_lock",
    "read_regular",
    "resolved",
    "schema_document",
    "sha256_bytes",
    "sha256_file",
    "write_output",
]

LOCK_NAME = ".attn-export.lock"
#: How long a build waits for another build of the same folder: long enough for a CI job's
#: concurrent build to finish, short enough to fail a stuck one.
LOCK_WAIT_S = 300.0
_CHUNK = 1 << 20
#: How often a build makes its folder again where another build, which wrote nothing, removed
#: it between the making and the locking: each time is such a build ending in that instant.
_VANISHED_TRIES = 8


def schema_document(text: str, where: str, schema: str, version: int, kind: str, rebuild: str) -> dict[str, Any]:
    """A JSON object of ``schema`` at ``version`` (the manifest, an intermediates file's
    meta): anything else is an ArtifactError naming ``where`` and, for another version,
    how to ``rebuild``."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{where}: not valid JSON ({first_line(e) or 'nested too deeply'})") from e
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        raise ArtifactError(f"{where}: not an attn-export {kind}")
    if doc.get("schema_version") != version:
        raise ArtifactError(f"{where}: {kind} schema_version {doc.get('schema_version')!r} is not {version}; {rebuild}")
    return doc


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resolved(path: Path) -> Path:
    """``path`` with its symbolic links followed; a loop of them is an ArtifactError naming
    ``path`` (Python raises RuntimeError or OSError, which read as internal errors)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:
        raise ArtifactError(f"{path}: refused: a loop of symbolic links") from e


@contextlib.contextmanager
def open_regular(path: Path, root: Path | None = None, limit: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """Open ``path`` for reading, with its size, if it is a regular file (after symlinks,
    which must stay inside ``root`` when given) of at most ``limit`` bytes."""
    if root is not None and not resolved(path).is_relative_to(resolved(root)):
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


#: A graph or golden file staged during a rebuild: ``.<stable name>.<sha256 prefix>.staged``.
STAGED = re.compile(r"\.(?P<stable>.+)\.[0-9a-f]{16}\.staged")

_NOT_FILES = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def output_target(path: Path) -> Path:
    """Where a file the user named (a report, a plot, an exported graph) is written: ``path``
    when it is new or a regular file, the file a symlink points to when that is a regular
    file. Anything else there (a device, a FIFO, a socket, a directory, a symlink to one of
    them or to nothing) is a UsageError and is left as it is: writing would replace it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from e
    target = path
    if stat.S_ISLNK(mode):
        try:
            target = path.resolve(strict=True)
            mode = os.stat(target).st_mode
        except (OSError, RuntimeError) as e:
            raise UsageError(f"{path} is a symlink to nothing; name a regular file or a new path") from e
    if not stat.S_ISREG(mode):
        kind = _NOT_FILES.get(stat.S_IFMT(mode), "not a regular file")
        via = f" (the symlink's target {target})" if target != path else ""
        raise UsageError(f"{path} is {kind}{via}; reports are written only to a regular file or a new path")
    return target


def write_output(path: Path, data: bytes) -> None:
    """``data`` to a file the user named, atomically, never replacing what is not a regular
    file (``output_target``)."""
    atomic_write(output_target(path), data)


def append_output(path: Path, text: str, errors: str = "strict") -> None:
    """Append ``text`` to a file the user named (``$GITHUB_STEP_SUMMARY``), created if new;
    a FIFO or a device there is refused instead of blocking or writing to it."""
    target = output_target(path)
    try:
        with open(target, "a", encoding="utf-8", errors=errors) as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot append to {path}: {e.strerror}") from e


@contextlib.contextmanager
def build_lock(out_dir: Path, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` so two builds never interleave their writes, and
    no verify reads a folder half rebuilt; wait up to ``wait_s`` seconds for another build
    (or a verify) to release it, telling ``on_wait`` once. Where nothing but the lock file
    is left in the folder at the end, it goes, and so do the folders made for it: a build
    that wrote nothing leaves nothing."""
    deadline, vanished, on_wait = time.monotonic() + wait_s, 0, _once(on_wait)
    while True:
        made = [p for p in (out_dir, *out_dir.parents) if not os.path.lexists(p)]
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot use output directory {out_dir}: {e.strerror}") from e
        fd = _open_lock(out_dir, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        if fd is None:  # a build that wrote nothing removed the folder between the two calls
            vanished += 1
            if vanished > _VANISHED_TRIES:
                raise UsageError(f"cannot use output directory {out_dir}: it no longer exists")
            continue
        if _acquired(fd, out_dir, True, deadline, wait_s, on_wait):
            break
        # the build that held it removed its lock file: lock the folder anew
    try:
        yield
    finally:
        try:
            _remove_if_empty(out_dir, made)
        finally:
            os.close(fd)


def _once(tell: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """``tell`` heard once however many times a build waits (a lock file removed and taken
    anew, then another build's)."""
    if tell is None:
        return None
    told: list[str] = []

    def once(line: str) -> None:
        if not told:
            told.append(line)
            tell(line)

    return once


def _remove_if_empty(out_dir: Path, made: Sequence[Path]) -> None:
    """The lock file, where it is all ``out_dir`` holds, and then the folders in ``made``
    (created for it, innermost first) left empty; removed under the lock, which a waiting
    build sees (``_acquired``) and takes anew."""
    try:
        if [p.name for p in out_dir.iterdir()] != [LOCK_NAME]:
            return
        (out_dir / LOCK_NAME).unlink()
        for folder in made:
            folder.rmdir()
    except OSError:
        return  # kept: a file written meanwhile, or a folder that cannot be changed


@contextlib.contextmanager
def read_lock(out_dir: Path, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold a shared lock on ``out_dir`` while verify reads it, so a build never rewrites it
    meanwhile (verify would see files that changed after the build and cry tamper); wait up
    to ``wait_s`` seconds for a build in progress. A folder no build ever locked (or copied
    without its lock file) needs none, and nothing is created in it."""
    deadline, on_wait = time.monotonic() + wait_s, _once(on_wait)
    while True:
        fd = _open_lock(out_dir, os.O_RDONLY)
        if fd is None:
            yield
            return
        if _acquired(fd, out_dir, False, deadline, wait_s, on_wait):
            break
    try:
        yield
    finally:
        os.close(fd)


def _open_lock(out_dir: Path, flags: int) -> int | None:
    """The lock file opened never through a symlink (a lock file planted as a link would
    create or lock its target) and never waiting (a FIFO planted there would block the open
    for good); None where it does not exist and is not created."""
    try:
        return os.open(out_dir / LOCK_NAME, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{out_dir / LOCK_NAME} is a symlink; remove it (a build folder holds no links)") from e
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
            raise UsageError(f"{out_dir / LOCK_NAME} is not a regular file; remove it") from e
        raise UsageError(f"cannot use {out_dir}: {e.strerror}") from e


def _acquired(
    fd: int, out_dir: Path, exclusive: bool, deadline: float, wait_s: float, on_wait: Callable[[str], None] | None
) -> bool:
    """Whether the lock on ``fd`` is now held and ``fd`` is still the folder's lock file; fd
    is closed where not (a build that wrote nothing removes its lock file on release, and
    one that waited on it must lock the new one). A LockError past ``deadline``."""
    import fcntl

    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{out_dir / LOCK_NAME} is not a regular file; remove it")
        holder = "another attn-export build or verify" if exclusive else "an attn-export build in progress"
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = f" after waiting {wait_s:g} s" if wait_s else ""
                    raise LockError(
                        f"{out_dir} is locked by {holder}{waited}; try again when it ends (--wait SECONDS waits longer)"
                    ) from e
                if on_wait is not None:
                    on_wait(f"{out_dir} is locked by {holder}; waiting up to {wait_s:g} s")
                    on_wait = None
                time.sleep(min(0.1, left))
        held, now = os.fstat(fd), os.stat(out_dir / LOCK_NAME, follow_symlinks=False)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return True
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return False
