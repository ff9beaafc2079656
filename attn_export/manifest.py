"""The manifest: ``<out>/manifest.json``, the contract between ``build`` and ``verify``.

Schema (version 1) is documented in the README; ``Manifest.from_json`` rejects anything else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attn_export.artifacts import atomic_write
from attn_export.errors import ArtifactError
from attn_export.spec import ModelSpec, TensorSpec, spec_from_dict

__all__ = ["MANIFEST_NAME", "Manifest", "ManifestEntry", "load_manifest", "save_manifest"]

MANIFEST_NAME = "manifest.json"
SCHEMA = "attn-export/manifest"
SCHEMA_VERSION = 1


@dataclass
class ManifestEntry:
    """One built model: its files, their hashes, and the spec it came from."""

    name: str
    file: str
    sha256: str
    golden: str
    golden_sha256: str
    opset: int
    exporter: str
    build_key: str
    spec_hash: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    dims: dict[str, dict[str, int]]
    tolerance: dict[str, Any]
    versions: dict[str, str]
    spec: dict[str, Any]
    variant: str = "fp32"

    def model_spec(self) -> ModelSpec:
        """The spec as built (opset and exporter included), for rebuilding the original."""
        try:
            return spec_from_dict(self.spec)
        except Exception as e:
            raise ArtifactError(f"manifest entry '{self.name}' holds an invalid spec: {e}") from e

    def input_specs(self) -> list[TensorSpec]:
        return [TensorSpec.from_dict(t) for t in self.inputs]

    def output_specs(self) -> list[TensorSpec]:
        return [TensorSpec.from_dict(t) for t in self.outputs]


@dataclass
class Manifest:
    """All models built into one output directory, keyed by name."""

    toolkit_version: str
    models: dict[str, ManifestEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "toolkit_version": self.toolkit_version,
            "models": {k: asdict(v) for k, v in sorted(self.models.items())},
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ArtifactError(f"{where}: not an attn-export manifest")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{where}: manifest schema_version {doc.get('schema_version')!r} is not {SCHEMA_VERSION}"
            )
        models = doc.get("models")
        if not isinstance(models, dict):
            raise ArtifactError(f"{where}: 'models' must be an object")
        entries: dict[str, ManifestEntry] = {}
        for name, raw in models.items():
            try:
                entry = ManifestEntry(**raw)
            except TypeError as e:
                raise ArtifactError(f"{where}: entry '{name}' does not fit the schema ({e})") from e
            if Path(entry.file).name != entry.file or Path(entry.golden).name != entry.golden:
                raise ArtifactError(f"{where}: entry '{name}' names a file outside the output directory")
            entries[name] = entry
        return cls(str(doc.get("toolkit_version", "")), entries)


def load_manifest(out_dir: Path) -> Manifest:
    """Read ``<out_dir>/manifest.json``; a missing or malformed one is an ArtifactError."""
    path = out_dir / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: no manifest; run 'attn-export build --out {out_dir}' first") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: cannot read manifest: {e}") from e
    return Manifest.from_json(text, str(path))


def save_manifest(out_dir: Path, manifest: Manifest) -> None:
    atomic_write(out_dir / MANIFEST_NAME, manifest.to_json().encode())
