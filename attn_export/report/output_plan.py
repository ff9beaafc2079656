"""Where a command's reports go: one ``OutputPlan`` per command, made once from its report
options and what it reads, that refuses before any work every target that cannot take a
report and writes the reports at the end (a refusal after the work lost its report)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click

from attn_export._deps import require
from attn_export.artifacts.files import LOCK_NAME, append_output, output_target, resolved, write_output
from attn_export.artifacts.manifest import MANIFEST_NAME, is_build_folder
from attn_export.errors import AttnExportError, UsageError

if TYPE_CHECKING:
    from attn_export.report.base import BenchFormat

__all__ = ["STDOUT", "JsonTarget", "OutputPlan", "check_appended", "folder_graphs"]

#: ``--json -``: the JSON goes to stdout, in place of the text the command prints there.
STDOUT: Literal["-"] = "-"

#: Where a report option writes: a file, or ``STDOUT`` (``--json`` only).
JsonTarget = Path | Literal["-"]

#: Paths that are not UTF-8 (a folder named in another encoding) reach the reports as
#: lone surrogates; they are written as ``\udcff`` escapes instead of failing the write.
ERRORS = "backslashreplace"

#: The suffixes no report is written to, and whose they are: the files a build folder, a
#: checkout or a bundle holds.
_NOT_REPORTS = {".onnx": "an ONNX graph's", ".npz": "a golden file's", ".toml": "a spec's", ".py": "Python source's"}

_SUMMARY = "$GITHUB_STEP_SUMMARY"


@dataclass(frozen=True)
class OutputPlan:
    """A command's reports: each option's file, whether ``--json -`` holds stdout (the
    command's text then goes nowhere), and ``$GITHUB_STEP_SUMMARY`` where the command
    appends its Markdown to it. Made by ``make``, which checks every target."""

    files: dict[str, Path] = field(default_factory=dict)
    to_stdout: bool = False
    summary: Path | None = None

    @classmethod
    def make(
        cls,
        given: Mapping[str, JsonTarget | None],
        *,
        reads: Iterable[Path] = (),
        graphs: Iterable[Path] = (),
        read_builds: Iterable[Path] = (),
        build: Path | None = None,
        build_files: Sequence[str] = (),
        made: Path | None = None,
        summary: bool = False,
        into_builds: bool = True,
        formats: Mapping[str, BenchFormat] | None = None,
    ) -> OutputPlan:
        """The plan of the report options ``given`` (format name -> a file, ``STDOUT`` or
        None), every target checked now (``_check``): refused after the work, a report is lost.
        The command ``reads`` files, the external data of ``graphs`` and the manifest and lock
        of ``read_builds``; verifies or makes ``build``, whose manifest, lock and
        ``build_files`` stay its own; makes the folder ``made``; appends to
        ``$GITHUB_STEP_SUMMARY`` with ``summary``; reads no build folder, so writes into none,
        without ``into_builds``; and checks ``formats``' suffixes and packages (bench's)."""
        files = {name: Path(t) for name, t in given.items() if t is not None and t != STDOUT}
        summary_file = os.environ.get("GITHUB_STEP_SUMMARY") if summary else None
        plan = cls(files, given.get("json") == STDOUT, Path(summary_file) if summary_file else None)
        for name, path in files.items():
            if (fmt := (formats or {}).get(name)) is None:
                continue
            if fmt.suffixes and path.suffix.lower() not in fmt.suffixes:
                suffixes = ", ".join(fmt.suffixes)
                raise UsageError(f"--{name} {path}: write a {suffixes} file (the suffix picks the format)")
            if fmt.requires:
                require(fmt.requires, f"--{name}")
        labels = [(f"--{name}", path) for name, path in files.items()]
        labels += [(_SUMMARY, plan.summary)] if plan.summary is not None else []
        # what the command reads is resolved now, so that a loop of links there is refused now
        read = {resolved(p) for p in [*reads, *_builds_files(read_builds)]}
        kept = {resolved(build / n): n for n in [MANIFEST_NAME, LOCK_NAME, *build_files]} if build else {}
        if labels:  # the graphs are read for their external data only when a report may clobber it
            read |= {resolved(p) for p in _graph_data(graphs)}
            _check(labels, made, read, kept, build, into_builds)
        return plan

    def echo(self, text: str) -> None:
        """``click.echo`` for the command's text, or nothing where ``--json -`` holds stdout."""
        if not self.to_stdout:
            click.echo(text)

    def write(
        self,
        write_file: Callable[[str, Path], None],
        json: Callable[[], str] | None = None,
        markdown: Callable[[], str] | None = None,
    ) -> None:
        """Each file, by ``write_file(name, path)``; ``markdown`` appended to
        ``$GITHUB_STEP_SUMMARY`` where the plan holds it; ``json`` on stdout for ``--json -``."""
        for name, path in self.files.items():
            write_file(name, path)
        if self.summary is not None and markdown is not None:
            try:
                append_output(self.summary, markdown(), ERRORS)
            except UsageError as e:
                raise UsageError(f"{_SUMMARY}: {e}") from e
        if self.to_stdout and json is not None:
            click.echo(json(), nl=False)

    def write_texts(self, texts: Mapping[str, Callable[[], str]], markdown: Callable[[], str] | None = None) -> None:
        """``write`` of reports that are text: each name's text, made only where it is written."""

        def write_file(name: str, path: Path) -> None:
            write_output(path, texts[name]().encode("utf-8", ERRORS))

        self.write(write_file, texts.get("json"), markdown)


def _check(
    labels: list[tuple[str, Path]],
    made: Path | None,
    read: set[Path],
    kept: dict[Path, str],
    build: Path | None,
    into_builds: bool,
) -> None:
    """Refuse a target that is not a regular file or a new path (``output_target``), whose
    folder is missing (outside ``made``) or takes no file, that another report names, that
    the command reads, that is any build folder's manifest or lock, or inside one (without
    ``into_builds``), a graph, golden file, spec or module, or ``kept``: written over, the
    run passes and what it read is gone. Each target in turn, the rules in this order: it
    says which one line a target gets."""
    taken: dict[Path, str] = {}
    for label, path in labels:
        try:
            target = resolved(output_target(path))
        except UsageError as e:
            raise UsageError(f"{label}: {e}" if label.startswith("$") else str(e)) from None
        folder = resolved(path.parent)
        if not folder.is_dir() and (made is None or not folder.is_relative_to(resolved(made))):
            raise UsageError(f"cannot write {path}: no folder {path.parent}")
        if folder.is_dir():
            _probe(path, folder)
        if target in taken:
            raise UsageError(f"{taken[target]} and {label} both name {path}: give each report a file of its own")
        taken[target] = label
        if target in read:
            raise UsageError(f"{label} {path} is a file this command reads; write the report elsewhere")
        if target in _builds_files([target.parent]) and is_build_folder(target.parent):
            raise UsageError(
                f"{label} {path} is {target.name} of the build folder {target.parent}; write the report elsewhere"
            )
        inside = None if into_builds else next((f for f in target.parents if is_build_folder(f)), None)
        if inside is not None:
            raise UsageError(f"{label} {path} is inside the build folder {inside}; write the report elsewhere")
        if whose := _NOT_REPORTS.get(target.suffix.lower()):
            raise UsageError(f"{label} {path}: {target.suffix} is {whose} suffix, not a report's; write it elsewhere")
        if (hit := kept.get(target)) is not None:
            raise UsageError(f"{label} {path} is {hit} of the build folder {build}; write the report elsewhere")


def check_appended(variable: str, path: Path) -> None:
    """The runner's file named by ``variable`` (``$GITHUB_OUTPUT``), which a step appends to,
    held to a report's rules (``_check``): a build folder's manifest or lock, a graph,
    golden file, spec or module appended to is no longer what it was."""
    try:
        _check([(variable, path)], None, set(), {}, None, into_builds=True)
    except UsageError as e:  # each message names the variable, as the first words of most do
        raise UsageError(str(e) if str(e).startswith(variable) else f"{variable}: {e}") from None


def _probe(path: Path, folder: Path) -> None:
    """A report is written through a temporary file in its folder (``atomic_write``): a
    folder that takes none (read-only, ``/proc``) is refused before the work, not after it."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def _builds_files(folders: Iterable[Path]) -> list[Path]:
    """The files of build folders no report may be written over that the suffixes do not
    already name: each one's manifest and lock (and its graphs' data: ``_graph_data``)."""
    return [f / name for f in folders for name in (MANIFEST_NAME, LOCK_NAME)]


def folder_graphs(folder: Path, names: Iterable[str] | None = None) -> Iterator[Path]:
    """The graphs a build folder's manifest names (those of ``names``), for a plan's
    ``graphs``: read when the plan asks for them (a report is asked for), not before; none
    where it has no manifest that reads (the command itself says so)."""
    from attn_export.artifacts.manifest import load_manifest

    if not (folder / MANIFEST_NAME).is_file():
        return
    try:
        models = load_manifest(folder).models
    except AttnExportError:
        return
    yield from (folder / e.file for n, e in models.items() if names is None or n in names)


def _graph_data(graphs: Iterable[Path]) -> list[Path]:
    """The external data files ``graphs`` read (a report written over one loses its
    weights), each graph read as data; one that does not parse is the command's to report."""
    from attn_export.artifacts.onnx_file import external_data_files, load_model_file

    found = []
    for graph in graphs:
        try:
            found += [graph.parent / name for name in external_data_files(load_model_file(graph))]
        except (AttnExportError, OSError):
            continue  # the command itself says what is wrong with it
    return found
