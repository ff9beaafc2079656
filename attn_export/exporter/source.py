"""The source files a spec's module is made of, found and hashed without running them.

Build keys and verify's stale-build check cover these files: the module's own file and,
transitively, every file it imports from the spec's folder or from the module's own
top-level package; a module from an installed library (site-packages) is covered by the
library's name and version instead. Files are located on disk (the spec's folder, then ``sys.path``) and
read as text; nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path

from attn_export.model_spec import ModelSpec

__all__ = ["module_sources"]


def _locate(name: str, roots: list[Path]) -> tuple[Path, Path] | None:
    """The file of module ``name`` and the root it was found under."""
    parts = name.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, root
    return None


def _imported(path: Path, package: str) -> list[str]:
    """Module names a file imports (relative imports resolved against ``package``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names += [prefix] + [f"{prefix}.{a.name}" for a in node.names if prefix]
    return [n for n in names if n]


def _roots(folder: Path | None, top: str) -> list[Path]:
    """Where modules are looked for: the spec's folder, ``sys.path``, and the folder that
    holds ``top`` when an import hook (an editable install) provides it. Locating a
    top-level name runs none of its code."""
    roots = ([folder] if folder else []) + [Path(p or ".") for p in sys.path if Path(p or ".").is_dir()]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin and found.origin not in ("built-in", "frozen"):
        origin = Path(found.origin)
        roots.append(origin.parent.parent if origin.name == "__init__.py" else origin.parent)
    return roots


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Installed distributions by the top-level packages they provide: read once per
    process, since reading them opens every distribution's record (0.2 s a time)."""
    return importlib.metadata.packages_distributions()


def _installed(top: str, path: Path) -> str | None:
    """``name==version`` of the distribution providing package ``top`` when ``path`` lies in
    an installed library (site-packages), else None (the checkout, a spec's folder)."""
    if not {"site-packages", "dist-packages"} & set(path.parts):
        return None
    for fresh in (False, True):
        if fresh:  # uninstalled since it was read
            _distributions.cache_clear()
        names = _distributions().get(top, [])
        try:
            return f"{names[0]}=={importlib.metadata.version(names[0])}" if names else None
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def module_sources(spec: ModelSpec) -> dict[str, str]:
    """``{file relative to its root: sha256}`` for the module and what it imports from the
    spec's folder or its own top-level package; empty when the module's file is not found."""
    folder = Path(spec.search_path) if spec.search_path else None
    module_name = spec.module.partition(":")[0]
    roots = _roots(folder, module_name.split(".")[0])
    first = _locate(module_name, roots)
    if first is None:
        return {}
    top = module_name.split(".")[0]
    installed = _installed(top, first[0])
    if installed:
        # A library installed from a registry changes by its version; walking it file by
        # file (transformers: some 2,500 files) would cost a minute on every verify.
        return {f"{installed} (installed)": hashlib.sha256(installed.encode()).hexdigest()}
    own_package = first[1] / top if (first[1] / top).is_dir() else None
    found: dict[Path, Path] = {}
    queue = [(module_name, first)]
    while queue:
        name, (path, root) = queue.pop()
        if path in found:
            continue
        found[path] = root
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for imported in _imported(path, package):
            hit = _locate(imported, roots)
            if hit is None:
                continue
            inside = (folder is not None and hit[0].is_relative_to(folder)) or (
                own_package is not None and hit[0].is_relative_to(own_package)
            )
            if inside and hit[0] not in found:
                queue.append((imported, hit))
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path, root in sorted(found.items())
    }
