"""A graph no build made (edited by hand after a build, or exported by a script of the
user's), judged as a built one is: a manifest of one entry, made in memory from the spec
named on the command line and the file's own hash. The spec is the user's code, named by
them, and nothing is read from or written to the graph's folder besides the graph."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from attn_export import __version__
from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.manifest import Manifest, ManifestEntry, is_build_folder
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.artifacts.provenance import versions
from attn_export.checks.spec_learning import learned_spec, needs_module
from attn_export.errors import ArtifactError, GraphCheckError, OptionError
from attn_export.exporter.graph_checks import check_spec_signature
from attn_export.exporter.source import module_sources
from attn_export.model_spec import ModelSpec, load_spec, variant_chain, variant_key

__all__ = ["changed_since", "check_described", "check_graph_file", "outside_manifest", "outside_spec"]


def check_graph_file(graph: Path, variant: str) -> None:
    """``graph`` as ``--spec`` takes it: one .onnx file that exists, of a variant that is a
    graph (not a chooser)."""
    if graph.suffix != ".onnx" or graph.is_dir():
        raise OptionError(
            "{graph}: {spec_file} judges one .onnx file, not a folder or another file", ["spec_file"], graph=graph
        )
    if not graph.is_file():
        raise ArtifactError(f"{graph}: no such file")
    if variant_chain(variant).chooser:
        chooser = "{variant} {value} chooses among variants; name the variant of the graph"
        raise OptionError(chooser, ["variant"], value=variant)


def check_described(proto: onnx.ModelProto, graph: Path, spec: ModelSpec, spec_path: Path) -> None:
    """OptionError where ``spec_path``'s spec does not describe ``graph`` (its inputs and
    outputs): no case could feed it."""
    try:
        check_spec_signature(proto, graph.name, spec)
    except GraphCheckError as e:
        other = "{error}: {spec_file} {value} does not describe this graph"
        raise OptionError(other, ["spec_file"], error=e, value=spec_path) from None


def outside_manifest(graph: Path, spec_path: Path, variant: str = "fp32") -> tuple[Path, Manifest, list[str]]:
    """``graph``'s folder, a manifest listing ``graph`` alone as the model of ``spec_path``
    (named as build names ``variant``'s graph, judged by its tolerance), and that name.
    The entry's spec, sources and versions are the checkout's, so it is never stale; its
    hash is the file's as read now (``changed_since``). A spec in a build folder, or in any
    folder below one, is refused: its module would be code from a folder that is data."""
    check_graph_file(graph, variant)
    spec = load_spec(spec_path)  # data only: a spec names its module, which is imported later
    home = spec_path.resolve().parent
    for folder in (home, *home.parents):
        if is_build_folder(folder):
            inside = "{spec_file} {value} lies in the build folder {folder}: verify runs code only from the "
            inside += "checkout, never from a build folder; name the checkout's spec"
            raise OptionError(inside, ["spec_file"], value=spec_path, folder=folder)
    if needs_module(spec):
        from attn_export.exporter.factory import instantiate

        spec = learned_spec(instantiate(spec), spec)
    name = variant_key(spec.name, variant)
    check_described(load_model_file(graph), graph, spec, spec_path)
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


def outside_spec(spec_path: Path, entry: ManifestEntry) -> ModelSpec:
    """The spec a graph no build made is judged by: the file's, with the values its ids
    take (``ModelSpec.vocab``), which ``outside_manifest`` read from the module."""
    return dataclasses.replace(load_spec(spec_path), vocab=entry.model_spec.vocab)


def changed_since(out_dir: Path, entry: ManifestEntry) -> str | None:
    """What to say where the graph no longer has the hash it was listed with: verify read it
    again for each run, and a file changed meanwhile was not the one judged."""
    try:
        now = sha256_file(out_dir / entry.file)
    except ArtifactError as e:
        return f"{entry.name}: {entry.file} cannot be read again after it was verified: {e}"
    if now == entry.sha256:
        return None
    return (
        f"{entry.name}: {entry.file} changed while it was verified (sha256 {entry.sha256[:12]}... when read, "
        f"{now[:12]}... now); verify it again"
    )
