"""Which built models verify runs, and whether each may run: the manifest's files intact,
the graph sound, the checkout's spec and sources unchanged since the build."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.genai_folder import CONFIG_NAME, GENAI_DIR, GRAPH_NAME
from attn_export.artifacts.golden import GoldenCase, read_golden
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, ManifestEntry, load_manifest
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.checks.spec_learning import checkout_ranges
from attn_export.errors import ArtifactError, GraphCheckError, OptionError, UsageError
from attn_export.exporter.graph_checks import (
    check_deterministic,
    check_float32_softmax,
    check_model,
    check_spec_axes,
    check_spec_signature,
    only_shapes_rejected,
)
from attn_export.exporter.source import module_sources
from attn_export.model_spec import ModelSpec, load_spec
from attn_export.model_spec.cache import cache_of
from attn_export.model_spec.distributions import case_label, split_label
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.shapes import golden_plan
from attn_export.model_spec.tolerance import rounding_name
from attn_export.pipelines.verify.outside import outside_manifest

__all__ = [
    "build_golden",
    "checkout_spec",
    "decoder_names",
    "genai_integrity",
    "graph_problems",
    "integrity",
    "parse_shard",
    "plain_export",
    "select_models",
    "shard_names",
    "stale_against_checkout",
    "stale_reasons",
]


def parse_shard(value: str) -> tuple[int, int]:
    """``"i/n"`` (ASCII digits, 1-based) as ``(i, n)``; UsageError for anything else."""
    i, sep, n = value.partition("/")
    if not (sep and i.isascii() and n.isascii() and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise UsageError(f"{value!r} is not i/n with 1 <= i <= n (e.g. 2/4)")
    return int(i), int(n)


def shard_names(names: Sequence[str], shard: tuple[int, int] | None) -> list[str]:
    """Deterministic round-robin over sorted names; shard is 1-based ``(i, n)``."""
    ordered = sorted(names)
    if shard is None:
        return ordered
    i, n = shard
    if not (n >= 1 and 1 <= i <= n):
        raise OptionError("{shard} {value}: expected i/n with 1 <= i <= n", ["shard"], value=f"{i}/{n}")
    return [name for k, name in enumerate(ordered) if k % n == i - 1]


def decoder_names(
    manifest: Manifest, names: Sequence[str], scenario: str, on_notice: Callable[[str], None] | None = None
) -> list[str]:
    """The models of ``names`` that have a key/value cache, which ``--scenario`` runs; the
    others are left out (``on_notice`` hears which), and none left is a UsageError."""
    kept = [n for n in names if cache_of(manifest.models[n].model_spec) is not None]
    left_out = [n for n in names if n not in kept]
    if not kept:
        none = f"{{scenario}} {{value}}: none of {', '.join(names)} has a key/value cache"
        raise OptionError(none, ["scenario"], value=scenario)
    if left_out and on_notice:
        on_notice(f"--scenario {scenario} runs decoders only: leaving out {', '.join(left_out)} (no key/value cache)")
    return kept


def select_models(
    paths: Sequence[Path], spec_file: Path | None = None, variant: str = "fp32"
) -> tuple[Path, Manifest, list[str]]:
    """Resolve ``DIR`` or ``FILES...`` (all in one build folder) to a manifest and model
    names; or with ``spec_file``, one .onnx file no build made (``outside_manifest``)."""
    if spec_file is not None:
        if len(paths) != 1:
            raise OptionError("{spec_file} verifies one .onnx file: give exactly one", ["spec_file"])
        return outside_manifest(paths[0], spec_file, variant)
    if not paths:
        raise UsageError("give a build folder or .onnx files from one")
    if len(paths) == 1 and paths[0].is_dir():
        manifest = load_manifest(paths[0])
        return paths[0], manifest, sorted(manifest.models)
    folders = {p.parent.resolve() for p in paths}
    if len(folders) != 1:
        raise UsageError("all files given to verify must come from one build folder")
    for p in paths:
        if p.is_dir():
            raise UsageError(f"{p}: give either one build folder or .onnx files")
        if not p.exists():
            raise ArtifactError(f"{p}: no such file")
    out_dir = paths[0].parent
    if not (out_dir / MANIFEST_NAME).exists() and len(paths) == 1:
        raise ArtifactError(
            f"{paths[0]}: no manifest beside it, so no build made it; verify a graph of your own against its spec "
            f"with --spec SPEC.toml, or run 'attn-export build --out {out_dir}' first"
        )
    manifest = load_manifest(out_dir)
    by_file = {e.file: name for name, e in manifest.models.items()}
    names = []
    for p in paths:
        if p.name not in by_file:
            raise ArtifactError(f"{p}: not listed in {out_dir / 'manifest.json'}")
        names.append(by_file[p.name])
    return out_dir, manifest, names


def build_golden(out_dir: Path, entry: ManifestEntry, budget: int) -> list[GoldenCase]:
    """The golden file of a built graph, read as data (``read_golden``: headers, dtypes and
    shapes at its cases' sizes), holding every case build records (``golden_plan``): a
    file cut to a case where no fault shows would pass; and, for an int8 graph, what int8
    rounding does to the module (``GoldenCase.int8``), which a file written before build
    recorded it lacks: its right graph would fail where int8 loses much."""
    path = out_dir / entry.golden
    cases = read_golden(path, entry.model_spec, budget, out_dir)
    missing, wanted = missing_cases(entry.model_spec, cases), len(golden_plan(entry.model_spec))
    if missing:
        raise ArtifactError(
            f"{path}: the golden file lacks {len(missing)} of the {wanted} cases build records "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); rebuild it with attn-export build"
        )
    tolerances = entry.model_spec.tolerances(entry.variant)
    rounded = [(name, t) for name, t in tolerances.items() if t.int8_rounding]
    if rounded and not any(t.rounding_key(name) in c.int8 for c in cases for name, t in rounded):
        raise ArtifactError(
            f"{path}: the golden file records no {rounding_name(rounded[0][1].weight_bits)} rounding, which "
            f"{entry.name} is judged by (an older attn-export wrote it); rebuild it with attn-export build"
        )
    return cases


def missing_cases(spec: ModelSpec, cases: Sequence[GoldenCase]) -> list[str]:
    """The labels of the cases build records for ``spec`` (``golden_plan``) that ``cases``
    lack, each matched by what it holds (``_point``)."""
    wanted = {_point(case_label(p.label, d), p.sizes): case_label(p.label, d) for p, d in golden_plan(spec)}
    recorded = {_point(c.label, c.sizes) for c in cases}
    return [label for key, label in wanted.items() if key not in recorded]


def _point(label: str, sizes: Mapping[str, int]) -> tuple[str, str, tuple[tuple[str, int], ...]]:
    """A golden case as what it holds: its mask case, distribution and sizes, not its label.
    Where two points share sizes one label is kept, and which follows the dims' order: the
    manifest's copy of the spec (dims sorted) kept another corner's label than the build
    (a guard's point on a corner), and verify refused the build for a label it never wrote."""
    shape, distribution = split_label(label)
    return (shape if shape in CASES else "", distribution, tuple(sorted(sizes.items())))


def integrity(out_dir: Path, entry: ManifestEntry, *also: str, graph: bool = True) -> list[str]:
    """The graph's file (not with ``graph`` off: an edited copy of it stands in its place),
    and those named by ``also`` ("golden", "intermediates"), against the hashes the manifest
    records."""
    problems = []
    keys = ("file", *also) if graph else also
    for name, want in entry.files(*keys) if keys else []:
        got = sha256_file(out_dir / name, out_dir)
        if got != want:
            problems.append(_changed(entry, name, got, want))
    return problems


def _changed(entry: ManifestEntry, shown: str, got: str, want: str) -> str:
    return f"{entry.name}: {shown} changed after the build: sha256 {got[:12]}... != manifest {want[:12]}..."


def genai_integrity(out_dir: Path, entry: ManifestEntry) -> list[str]:
    """The files of the graph's genai folder (``build --target genai``) against the hashes
    the manifest records: the folder a user ships is the one judged, never a copy that
    drifted from it; a missing or unreadable one is said, not raised."""
    folder = out_dir / GENAI_DIR / entry.name
    unhashed = [n for n in (GRAPH_NAME, CONFIG_NAME) if entry.genai and n not in entry.genai]
    problems = [f"{entry.name}: the manifest records no sha256 of {GENAI_DIR}/{entry.name}/{n}" for n in unhashed]
    for name, want in sorted(entry.genai.items()):
        try:
            got = sha256_file(folder / name, out_dir)
        except ArtifactError as e:
            problems.append(f"{entry.name}: {e}")
            continue
        if got != want:
            problems.append(_changed(entry, f"{GENAI_DIR}/{entry.name}/{name}", got, want))
    return problems


def plain_export(out_dir: Path, manifest: Manifest, entry: ManifestEntry) -> ManifestEntry | None:
    """The plain export of ``entry``'s model in the same build folder, built from the same
    spec, module sources and tool versions, its file intact: what a variant's fused regions
    are mapped back to (localize) and what labels its fully masked rows where its own graph
    has nothing to rewrite. None for a plain export itself, or where there is no such graph:
    it only ever adds to what is said of ``entry``, never stops its check."""
    plain = manifest.models.get(entry.model_spec.name)
    if entry.variant == "fp32" or plain is None or plain.variant != "fp32":
        return None
    if (plain.spec_hash, plain.sources, plain.versions) != (entry.spec_hash, entry.sources, entry.versions):
        return None
    try:
        return None if integrity(out_dir, plain) else plain
    except ArtifactError:  # missing or unreadable
        return None


def graph_problems(out_dir: Path, entry: ManifestEntry, outside: bool = False) -> tuple[list[str], bool, list[str]]:
    """Problems found in the graph itself, whether it is sound enough to run, and notes.

    A file that is not a loadable model is bad input (ArtifactError, exit 2). A graph the
    checker rejects, or whose inputs and outputs are not the spec's, is not run; one with
    wrong dynamic axes is, to show the consequences. A graph no build made (``outside``)
    names its dims as its exporter did (Optimum's ``batch_size``, genai's ``batch_size``),
    and where only onnx's strict shape inference rejects it, a note says so and ONNX Runtime
    judges it by running it: the file is what the user deploys, and it runs.
    """
    spec = entry.model_spec
    path = out_dir / entry.file
    proto = load_model_file(path)
    notes: list[str] = []
    try:
        try:
            check_model(proto, entry.name, path)
        except GraphCheckError as e:
            if not (outside and only_shapes_rejected(proto, path)):
                raise
            notes.append(f"{e} (a shape it declares; the graph passes onnx's structural check and is run)")
        check_deterministic(proto, entry.name)
        check_spec_signature(proto, entry.name, spec)
    except GraphCheckError as e:
        return [str(e)], False, notes
    try:
        check_spec_axes(proto, entry.name, spec, own_names=not outside)
        if "fp16" in entry.variant.split("+"):
            check_float32_softmax(proto, entry.name)
    except GraphCheckError as e:
        return [str(e)], True, notes
    return [], True, notes


#: Spec fields that do not change the PyTorch original or how it is judged (build overrides),
#: or that build learned from the module, which verify learns again (``checkout_spec``).
_EXPORT_ONLY = ("description", "opset", "exporter", "vocab")


def checkout_spec(models_dir: Path, entry: ManifestEntry, option: str = "--models", learn: bool = True) -> ModelSpec:
    """The checkout's spec for a built graph: the only source of code verify runs, with the
    guards the graph's export accepted (data: where verify must also look) and the values
    its ids take read again from the checkout's module, never from the manifest (a manifest
    narrowing them hid a table cut short; not with ``learn`` off, where torch need not be
    installed: golden mode). ``option`` is how the caller's user names the folder (the
    pytest plugin has its own)."""
    name = entry.model_spec.name
    path = models_dir / f"{name}.toml"
    if models_dir.is_dir() and path.is_file():
        spec = dataclasses.replace(load_spec(path), guards=entry.model_spec.guards)
        return checkout_ranges(spec) if learn else spec
    where = (
        f"no spec for model '{name}' in {models_dir}"
        if models_dir.is_dir()
        else f"{option} {models_dir}: no such model directory"
    )
    if not learn:  # golden mode reads the checkout's spec only where --models names it
        raise UsageError(
            f"{where}: --golden with {option} holds each recorded spec to the checkout's (pass {option} DIR, "
            "the folder the build read), or leave it out to judge by the spec the build recorded"
        )
    other = ", or compare with the build's golden vectors (--golden)" if option == "--models" else ""
    raise UsageError(
        f"{where}: PyTorch originals are rebuilt only from the checkout's specs (pass {option} DIR, "
        f"the folder the build read){other}"
    )


def stale_against_checkout(
    models_dir: Path, entry: ManifestEntry, spec: ModelSpec, golden: bool, checkout: bool
) -> list[str]:
    """``stale_reasons`` against the checkout's spec (``spec``, learned from it); in golden
    mode only where the checkout was named (``checkout``: else the folder is trusted whole),
    read without its module (torch need not be installed there)."""
    if golden and not checkout:
        return []
    return stale_reasons(entry, checkout_spec(models_dir, entry, learn=False) if golden else spec)


def stale_reasons(entry: ManifestEntry, spec: ModelSpec) -> list[str]:
    """What changed in the checkout since the graph was built; empty when nothing did.

    Compares data only (the spec's fields, the weights' and module files' hashes): nothing
    the manifest names is imported or run."""
    built, now = entry.spec, spec.to_dict()
    fields = sorted(k for k in set(built) | set(now) if k not in _EXPORT_ONLY and built.get(k) != now.get(k))
    reasons = [f"spec field{'s' if len(fields) > 1 else ''} {', '.join(fields)} differ"] if fields else []
    if not fields and spec.weights.path is not None and spec.content_hash() != entry.spec_hash:
        reasons.append(f"weights file {built['weights']['path']} changed")
    sources = module_sources(spec)
    changed = sorted(k for k in set(entry.sources) | set(sources) if entry.sources.get(k) != sources.get(k))
    if changed:
        reasons.append(f"module source {', '.join(changed)} changed")
    return reasons
