"""A graph no build made (edited by hand after a build, or exported by a script of the
user's), judged as a built one is: a manifest of one entry, made in memory from the spec
named on the command line and the file's own hash. The spec is the user's code, named by
them, and nothing is read from or written to the graph's folder besides the graph."""

from __future__ import annotations

from pathlib import Path

from attn_export import __version__
from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.manifest import Manifest, ManifestEntry
from attn_export.artifacts.provenance import versions
from attn_export.errors import ArtifactError, UsageError
from attn_export.exporter.source import module_sources
from attn_export.spec import load_spec, variant_chain

__all__ = ["outside_manifest"]


def outside_manifest(graph: Path, spec_path: Path, variant: str = "fp32") -> tuple[Path, Manifest, list[str]]:
    """``graph``'s folder, a manifest listing ``graph`` alone as the model of ``spec_path``
    (named as build names ``variant``'s graph, judged by its tolerance), and that name.
    The entry's spec, sources and versions are the checkout's, so it is never stale; its
    hash is the file's, so a graph that changes while it is verified still fails."""
    if graph.suffix != ".onnx":
        raise UsageError(f"{graph}: --spec judges one .onnx file, not a folder or another file")
    if not graph.is_file():
        raise ArtifactError(f"{graph}: no such file")
    if variant_chain(variant).chooser:
        raise UsageError(f"--variant {variant} chooses among variants; name the variant of the graph")
    spec = load_spec(spec_path)
    name = spec.name if variant == "fp32" else f"{spec.name}.{variant}"
    entry = ManifestEntry(
        name=name,
        file=graph.name,
        sha256=sha256_file(graph),
        golden="",
        golden_sha256="",
        build_key="",
        spec_hash=spec.content_hash(),
        sources=module_sources(spec),
        versions=versions(),
        spec=spec.to_dict(),
        variant=variant,
    )
    return graph.parent, Manifest(__version__, {name: entry}), [name]
