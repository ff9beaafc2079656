"""The build folder's commit protocol: the manifest is the one commit point.

A new graph, golden or intermediates file is first written, atomically, under a staged name
(``.<file>.<sha256 prefix>.staged``: hidden, content-addressed, never a model's name) that
no manifest names yet. The manifest is then swapped to name it (the commit); its bytes
are copied to the stable name ``<file>`` and the manifest swapped again; the staged files
are removed at the build's end, once no graph of the build can name them. At every
instant the manifest names complete files with the hashes it records, so an interrupted
build leaves each graph's previous or new entry, never a mix.

What an interruption leaves (temporary files, staged files no manifest names, entries still
naming staged files) is cleaned up by the next build, or by verify, with one line saying so.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from pathlib import Path

from attn_export.artifacts.files import STAGED as _STAGED
from attn_export.artifacts.files import atomic_write, build_lock, read_regular, sha256_bytes, sha256_file
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest, save_manifest
from attn_export.errors import ArtifactError, LockError, UsageError

__all__ = ["commit", "leftovers", "recover", "remove_leftovers", "stage", "tidy"]

#: ``atomic_write``'s temporary files: ``.<target>.<8 random characters>.tmp``.
_TEMP = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp")
_ARTIFACTS = (".onnx", ".npz", ".staged")


def stage(out_dir: Path, stable: str, data: bytes) -> tuple[str, str]:
    """Write ``data`` under its staged name for ``stable``; returns (name, sha256)."""
    sha = sha256_bytes(data)
    name = f".{stable}.{sha[:16]}.staged"
    atomic_write(out_dir / name, data)
    return name, sha


def _stable(name: str) -> str:
    match = _STAGED.fullmatch(name)
    return match["stable"] if match else name


def _promote(out_dir: Path, manifest: Manifest) -> bool:
    """Copy staged files to their stable names and point the entries there, unless another
    entry still names the stable file with other contents (a variant of an older build
    sharing the golden file). Returns whether any entry changed."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for e in manifest.models.values():
        for name, sha in e.files():
            wanted[name].add(sha)
    changed = False
    for e in manifest.models.values():
        for name_key, sha_key in e.artifacts():
            name, sha = getattr(e, name_key), getattr(e, sha_key)
            stable = _stable(name)
            if stable == name or not wanted[stable] <= {sha}:
                continue
            if not _holds(out_dir / stable, sha):
                try:
                    data = read_regular(out_dir / name, out_dir)
                except ArtifactError:
                    continue  # gone or replaced after the build: verify reports it
                if sha256_bytes(data) != sha:
                    continue
                atomic_write(out_dir / stable, data)
            setattr(e, name_key, stable)
            wanted[stable].add(sha)
            changed = True
    return changed


def _holds(path: Path, sha: str) -> bool:
    try:
        return path.exists() and sha256_file(path) == sha
    except ArtifactError:
        return False


def commit(out_dir: Path, manifest: Manifest, name: str, entry: ManifestEntry) -> None:
    """Make ``entry`` (naming staged files) part of the folder: swap in the manifest with
    it, move its files to their stable names, swap again. The staged files stay until the
    build's end (``remove_leftovers``): another graph of the build, committed next, may
    name the same staged file (a model's golden file), and other cells' staged files await
    their commit.

    ``manifest`` takes the entry only once it is on disk, so a failed first swap leaves
    memory and disk agreeing on the previous build."""
    candidate = Manifest(manifest.toolkit_version, {**manifest.models, name: entry})
    save_manifest(out_dir, candidate)
    manifest.models = candidate.models
    if _promote(out_dir, manifest):
        save_manifest(out_dir, manifest)


def leftovers(out_dir: Path, *manifests: Manifest) -> list[Path]:
    """Temporary files of artifacts, and staged files none of ``manifests`` names."""
    named = {n for m in manifests for e in m.models.values() for n, _ in e.files()}
    found = []
    for path in sorted(out_dir.iterdir()):
        temp = _TEMP.fullmatch(path.name)
        ours = temp is not None and (temp["target"] == MANIFEST_NAME or temp["target"].endswith(_ARTIFACTS))
        if ours or (_STAGED.fullmatch(path.name) and path.name not in named):
            found.append(path)
    return found


def remove_leftovers(out_dir: Path, *manifests: Manifest) -> list[Path]:
    """Remove ``leftovers`` (only under the build lock), as far as the folder allows: what
    stays is removed next time. Returns what was removed."""
    removed = []
    for path in leftovers(out_dir, *manifests):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def recover(out_dir: Path, manifest: Manifest) -> str | None:
    """At the start of a build (under its lock): finish an interrupted build's last step and
    remove its leftovers. Returns one line saying what was done, or None."""
    promoted = _promote(out_dir, manifest)
    if promoted:
        save_manifest(out_dir, manifest)
    removed = remove_leftovers(out_dir, manifest)
    if not (promoted or removed):
        return None
    done = [f"removed {_files(len(removed))} it left"] if removed else []
    done += ["moved its last graphs to their stable names"] if promoted else []
    return f"an earlier build of {out_dir} was interrupted; {' and '.join(done)}"


def tidy(out_dir: Path) -> str | None:
    """For verify: remove an interrupted build's leftovers if no build is running, and say
    so in one line. Verify never reads them (it reads only what the manifest names)."""
    try:
        if not leftovers(out_dir, load_manifest(out_dir)):
            return None  # the usual case: nothing to clean, and nothing written (not even the lock file)
        with build_lock(out_dir):
            manifest = load_manifest(out_dir)  # again, under the lock: a build may have just committed
            found = leftovers(out_dir, manifest)
            removed = remove_leftovers(out_dir, manifest)
    except LockError:
        return None  # a build is running: the files are its own
    except UsageError:
        return None  # a read-only folder: nothing can be cleaned, and verify reads only what the manifest names
    if not found:
        return None
    kept = f" ({len(found) - len(removed)} could not be removed)" if len(removed) < len(found) else ""
    return f"an earlier build of {out_dir} was interrupted; removed {_files(len(removed))} it left{kept}"
