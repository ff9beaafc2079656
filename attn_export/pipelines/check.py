"""``attn-export check``: the static checks, fast enough for a pre-commit hook.

Nothing runs a graph and nothing imports torch or ONNX Runtime: each graph is parsed and
held to ``onnx.checker`` (full check), no random op, its opset and operator domains on an
allow-list, and symbolic dims. A graph a ``manifest.json`` beside it names is also held to
that manifest: its own sha256 and those of the files recorded with it (golden file,
intermediates, generations, its onnxruntime-genai folder), the golden file read as ``verify
--golden`` reads it (every case build records, each array as the spec says), and the
spec's dynamic axes (each
symbolic, named as the spec names it, none merged with another). A graph no manifest names
has no spec to say which axes are dynamic; each of its axes must have a size or a name.

What the files hold is a finding (exit 1), a path that is none of these is bad usage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.onnx_file import load_model_file, max_supported_opset
from attn_export.errors import ArtifactError, GraphCheckError, OptionError, UsageError
from attn_export.exporter.graph_checks import (
    DEFAULT_DOMAINS,
    check_deterministic,
    check_domains,
    check_model,
    check_named_dims,
    check_opset,
    check_spec_axes,
)
from attn_export.model_spec.memory import memory_budget
from attn_export.pipelines.verify.models import build_golden, genai_integrity, integrity

__all__ = ["CHECKS", "CheckOptions", "CheckReport", "FileCheck", "check_paths"]

#: Every check by name, in the order they run (``load`` and ``manifest`` are not checks but
#: what stops them: a file that does not parse, a manifest that does not).
CHECKS = ("hashes", "golden", "checker", "random-ops", "opset-domain", "axes")
GOLDEN_SUFFIX = ".golden.npz"


@dataclass
class CheckOptions:
    """The allow-lists (defaults: any opset this installation's onnx defines, and
    ``DEFAULT_DOMAINS``)."""

    min_opset: int = 7
    #: None: the newest opset the installed onnx package defines.
    max_opset: int | None = None
    domains: Sequence[str] = DEFAULT_DOMAINS


@dataclass
class FileCheck:
    """One graph (or one file that could not be read as one): each check run and its
    problem, None where it passed."""

    path: str
    #: The manifest entry it was checked against; None for a graph no manifest names.
    model: str | None
    results: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(problem is None for problem in self.results.values())

    @property
    def problems(self) -> dict[str, str]:
        return {check: problem for check, problem in self.results.items() if problem is not None}


@dataclass
class CheckReport:
    """Every file ``check`` looked at; the JSON report is ``to_dict``."""

    files: list[FileCheck] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.files)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "attn-export/check-report",
            "schema_version": 1,
            "passed": self.passed,
            "seconds": self.seconds,
            "files": [asdict(f) | {"passed": f.passed} for f in self.files],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckReport:
        files = [FileCheck(f["path"], f["model"], dict(f["results"]), f["seconds"]) for f in d["files"]]
        return cls(files, d["seconds"])


def _run(results: dict[str, str | None], check: str, call: Callable[[], object]) -> None:
    try:
        call()
    except (GraphCheckError, ArtifactError) as e:
        results[check] = str(e)
    else:
        results[check] = None


def _graph_checks(
    results: dict[str, str | None], proto: onnx.ModelProto, name: str, path: Path, options: CheckOptions
) -> None:
    highest = options.max_opset or max_supported_opset()
    _run(results, "checker", lambda: check_model(proto, name, path))
    _run(results, "random-ops", lambda: check_deterministic(proto, name))

    def opset_and_domains() -> None:
        check_opset(proto, name, options.min_opset, highest)
        check_domains(proto, name, options.domains)

    _run(results, "opset-domain", opset_and_domains)


def _load(results: dict[str, str | None], path: Path) -> onnx.ModelProto | None:
    try:
        return load_model_file(path)
    except ArtifactError as e:
        results["load"] = str(e)
        return None


def _check_entry(out_dir: Path, entry: ManifestEntry, options: CheckOptions) -> FileCheck:
    found = FileCheck(str(out_dir / entry.file), entry.name)
    results = found.results
    try:
        changed = integrity(out_dir, entry, "golden", "intermediates", "generations")
    except ArtifactError as e:  # a file the manifest names is missing or unreadable
        changed = [str(e)]
    results["hashes"] = "; ".join(changed + genai_integrity(out_dir, entry)) or None
    _run(results, "golden", lambda: build_golden(out_dir, entry, memory_budget()))  # as verify --golden reads it
    proto = _load(results, out_dir / entry.file)
    if proto is not None:
        _graph_checks(results, proto, entry.name, out_dir / entry.file, options)
        spec = entry.model_spec
        _run(results, "axes", lambda: check_spec_axes(proto, entry.name, spec))
    return found


def _check_bare(path: Path, options: CheckOptions) -> FileCheck:
    found = FileCheck(str(path), None)
    proto = _load(found.results, path)
    if proto is not None:
        _graph_checks(found.results, proto, path.name, path, options)
        _run(found.results, "axes", lambda: check_named_dims(proto, path.name))
    return found


@dataclass(frozen=True)
class _Entry:
    """An entry of a build folder's manifest: its graph, checked with the manifest's hashes."""

    folder: Path
    name: str

    def check(self, manifests: dict[Path, Manifest], options: CheckOptions) -> FileCheck:
        return _check_entry(self.folder, manifests[self.folder].models[self.name], options)


@dataclass(frozen=True)
class _Bare:
    """A graph no manifest names: the graph checks alone."""

    path: Path

    def check(self, manifests: dict[Path, Manifest], options: CheckOptions) -> FileCheck:
        return _check_bare(self.path, options)


@dataclass(frozen=True)
class _Finding:
    """A problem found while resolving the paths (a manifest that does not load, a golden
    file none names)."""

    where: str
    name: str
    problem: str

    def check(self, manifests: dict[Path, Manifest], options: CheckOptions) -> FileCheck:
        return FileCheck(self.where, None, {self.name: self.problem})


_Target = _Entry | _Bare | _Finding


class _Resolver:
    """Turns paths into targets, loading each folder's manifest once."""

    def __init__(self) -> None:
        self.manifests: dict[Path, Manifest] = {}

    def entries(self, folder: Path, only: str | None = None) -> list[_Target]:
        """Each entry of ``folder``'s manifest (those naming the file ``only``, when given),
        or the manifest's own problem."""
        try:
            manifest = self.manifests.get(folder) or load_manifest(folder)
        except ArtifactError as e:
            return [_Finding(str(folder / MANIFEST_NAME), "manifest", str(e))]
        self.manifests[folder] = manifest
        return [
            _Entry(folder, name)
            for name, e in sorted(manifest.models.items())
            if only is None or only in (e.file, e.golden)
        ]

    def targets(self, path: Path) -> list[_Target]:
        if path.is_dir():
            if not (path / MANIFEST_NAME).exists():
                raise UsageError(f"{path}: a folder without {MANIFEST_NAME}; give a build folder, or its files")
            return self.entries(path)
        if not path.exists():
            raise UsageError(f"{path}: no such file")
        if path.name == MANIFEST_NAME:
            return self.entries(path.parent)
        is_golden = path.name.endswith(GOLDEN_SUFFIX)
        if path.suffix != ".onnx" and not is_golden:
            raise UsageError(f"{path}: not an .onnx file, a {GOLDEN_SUFFIX} file, a {MANIFEST_NAME} or a build folder")
        named = self.entries(path.parent, path.name) if (path.parent / MANIFEST_NAME).exists() else []
        if named:
            return named
        if is_golden:
            problem = f"{path}: no {MANIFEST_NAME} beside it names this golden file"
            return [_Finding(str(path), "hashes", problem)]
        return [_Bare(path)]


def check_paths(paths: Sequence[Path], options: CheckOptions | None = None) -> CheckReport:
    """Check every graph ``paths`` name (``.onnx`` files, ``.golden.npz`` files, manifests,
    build folders), each once; UsageError, before any check, for a path that is none."""
    options = options or CheckOptions()
    if not paths:
        raise UsageError("give .onnx files, manifest.json files or build folders to check")
    if options.max_opset is not None and options.max_opset < options.min_opset:
        below = "{max_opset} {value} is below {min_opset} {minimum}"
        raise OptionError(below, ["max_opset", "min_opset"], value=options.max_opset, minimum=options.min_opset)
    start = time.perf_counter()
    resolver = _Resolver()
    targets = list(dict.fromkeys(t for p in paths for t in resolver.targets(p)))
    report = CheckReport()
    for t in targets:
        began = time.perf_counter()
        found = t.check(resolver.manifests, options)
        found.seconds = time.perf_counter() - began
        report.files.append(found)
    report.seconds = time.perf_counter() - start
    return report
