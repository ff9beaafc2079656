"""The manifest: ``<out>/manifest.json``, the contract between ``build`` and ``verify``.

Each entry stores the spec it was built from once; opset, exporter, tensors, dims and
tolerances are read from that spec, never stored beside it. The schema (version 2) is in
the docs' file formats page; ``Manifest.from_json`` rejects anything else.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from attn_export.artifacts.files import LOCK_NAME, STAGED, atomic_write, read_regular, schema_document
from attn_export.artifacts.genai_folder import CONFIG_NAME, GENAI_DIR, GRAPH_NAME
from attn_export.artifacts.json_fields import json_record
from attn_export.artifacts.json_text import json_text
from attn_export.errors import ArtifactError, SpecError, UsageError
from attn_export.model_spec import ModelSpec, spec_from_dict, variant_chain, variant_key

__all__ = ["MANIFEST_NAME", "Manifest", "ManifestEntry", "is_build_folder", "load_manifest", "save_manifest"]

MANIFEST_NAME = "manifest.json"
#: A manifest is a few KiB per graph; anything near this is not one.
MAX_MANIFEST_BYTES = 64 << 20
SCHEMA = "attn-export/manifest"
SCHEMA_VERSION = 2


@dataclass
class ManifestEntry:
    """One built graph: its files, their hashes, and the spec it came from."""

    name: str
    file: str
    sha256: str
    golden: str
    golden_sha256: str
    build_key: str
    spec_hash: str
    #: sha256 of each source file of the module (``exporter.source``), for stale-build checks.
    sources: dict[str, str]
    versions: dict[str, str]
    spec: dict[str, Any]
    variant: str = "fp32"
    #: What the variant's transformation did (fusions, provider, auto's figures).
    variant_info: dict[str, Any] = field(default_factory=dict)
    #: PyTorch's value of every FX node on the smallest golden case (``build
    #: --record-intermediates``), so that ``localize --golden`` needs no torch; "" when none.
    intermediates: str = ""
    intermediates_sha256: str = ""
    #: PyTorch's greedy generations of a causal LM (``artifacts.generations``), for
    #: ``verify --golden --generate``; "" for any other model.
    generations: str = ""
    generations_sha256: str = ""
    #: The files of the folder ``build --target genai`` wrote for this graph
    #: (``genai/<name>/``), by their names there, with their sha256: what a user ships, which
    #: verify runs in genai's generator and ``check`` hashes; empty where none was written.
    genai: dict[str, str] = field(default_factory=dict)

    def artifacts(self) -> list[tuple[str, str]]:
        """The (file, sha256) attribute pairs of the files this entry names: the graph, the
        golden file and, when recorded, the intermediates and the generations. Every file the
        folder's commit protocol moves, hashes or keeps is one of these."""
        pairs = [("file", "sha256"), ("golden", "golden_sha256")]
        return pairs + [(key, f"{key}_sha256") for key in _OPTIONAL if getattr(self, key)]

    def files(self, *keys: str) -> list[tuple[str, str]]:
        """The (file name, sha256) of each file this entry names (``artifacts``), or of
        those named by ``keys`` ("file", "golden", "intermediates", "generations")."""
        return [(getattr(self, n), getattr(self, s)) for n, s in self.artifacts() if not keys or n in keys]

    @cached_property
    def model_spec(self) -> ModelSpec:
        """The spec as built (opset and exporter included), as data: it names no file that
        is resolved and no folder that is searched, and sets no memory budget (its
        ``max_memory`` is dropped: a budget is the reader's, ``model_spec.memory.memory_budget``)."""
        return replace(spec_from_dict(self.spec), max_memory=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Manifest:
    """All graphs built into one output directory, keyed by name."""

    toolkit_version: str
    models: dict[str, ManifestEntry] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """What names this build in a report: the hash of the manifest as saved (every
        graph's and golden file's hash, the specs, the tool versions; nothing else)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def to_json(self) -> str:
        doc = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "toolkit_version": self.toolkit_version,
            "models": {k: v.to_dict() for k, v in sorted(self.models.items())},
        }
        return json_text(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        rebuild = "rebuild the folder with this version (attn-export build --force)"
        doc = schema_document(text, where, SCHEMA, SCHEMA_VERSION, "manifest", rebuild)
        models = doc.get("models")
        if not isinstance(models, dict):
            raise ArtifactError(f"{where}: 'models' must be an object")
        entries = {name: _entry(name, raw, where) for name, raw in models.items()}
        return cls(str(doc.get("toolkit_version", "")), entries)


_HEX64 = re.compile(r"[0-9a-f]{64}")
#: The files an entry names only where they were recorded.
_OPTIONAL = ("intermediates", "generations")


def _entry(name: str, raw: Any, where: str) -> ManifestEntry:
    """Validate one entry: types, hashes, file names inside the folder, and its spec."""

    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"{where}: entry '{name}' {why}")

    entry = json_record(ManifestEntry, raw, f"{where}: models[{name!r}]")  # each field of its type
    for key in ("sha256", "golden_sha256", "spec_hash", *(f"{k}_sha256" for k in _OPTIONAL if getattr(entry, k))):
        value = getattr(entry, key)
        if not _HEX64.fullmatch(value):  # a string: json_record read it as one
            raise bad(f"has an invalid '{key}' (expected 64 hex digits)")
    for key in _OPTIONAL:
        if getattr(entry, f"{key}_sha256") and not getattr(entry, key):
            raise bad(f"has an '{key}_sha256' but no '{key}'")
    if entry.name != name:
        raise bad(f"is named '{entry.name}'")
    for file, digest in entry.genai.items():
        if Path(file).name != file or file in ("", ".", "..") or not _HEX64.fullmatch(digest):
            raise bad(f"names genai file {file!r} outside its folder or with an invalid sha256")
    for key, _ in entry.artifacts():
        value = getattr(entry, key)
        if not value or Path(value).name != value or value in (".", ".."):
            raise bad("names a file outside the output directory")
    try:
        variant_chain(entry.variant)
    except UsageError as e:
        raise bad(f"names a variant this version cannot make: {e}") from e
    try:
        spec = entry.model_spec
    except SpecError as e:
        raise bad(f"holds an invalid spec: {e}") from e
    if variant_key(spec.name, entry.variant) != name:
        raise bad(f"holds the spec of '{spec.name}' (variant {entry.variant})")
    stables = {"file": f"{name}.onnx", "golden": f"{spec.name}.golden.npz"}
    stables["intermediates"] = f"{name}.intermediates.npz"
    stables["generations"] = f"{spec.name}.generate.npz"
    for key, _ in entry.artifacts():
        value, stable = getattr(entry, key), stables[key]
        staged = STAGED.fullmatch(value)
        if value != stable and not (staged and staged["stable"] == stable):
            raise bad(f"names {key} '{value}', which is neither {stable} nor a staged copy of it")
    return entry


def is_build_folder(folder: Path) -> bool:
    """A folder a build locked, or whose manifest.json is attn-export's (not any file of that
    name a project may hold)."""
    if (folder / LOCK_NAME).exists():
        return True
    try:
        with open(folder / MANIFEST_NAME, encoding="utf-8") as f:
            return bool(re.search(rf'"schema"\s*:\s*"{re.escape(SCHEMA)}"', f.read(MAX_MANIFEST_BYTES)))
    except (OSError, UnicodeDecodeError):
        return False


def load_manifest(out_dir: Path) -> Manifest:
    """Read ``<out_dir>/manifest.json``; a missing or malformed one is an ArtifactError."""
    path = out_dir / MANIFEST_NAME
    if not path.exists():
        raise ArtifactError(f"{path}: no manifest; " + _instead(out_dir))
    try:
        text = read_regular(path, out_dir, MAX_MANIFEST_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: cannot read manifest: {e}") from e
    return Manifest.from_json(text, str(path))


def _instead(out_dir: Path) -> str:
    """What to do with a folder that holds no manifest: build into it, or, for the folder
    onnxruntime-genai loads that ``build --target genai`` wrote, verify its build or its graph."""
    if not (out_dir / CONFIG_NAME).is_file():
        return f"run 'attn-export build --out {out_dir}' first"
    root = out_dir.parent.parent if out_dir.parent.name == GENAI_DIR else None
    build = f"verify its build folder {root} (--generate runs this folder in genai's generator), or " if root else ""
    return f"{out_dir} is a folder for onnxruntime-genai: {build}verify {out_dir / GRAPH_NAME} --spec <its spec>"


def save_manifest(out_dir: Path, manifest: Manifest) -> None:
    atomic_write(out_dir / MANIFEST_NAME, manifest.to_json().encode())
