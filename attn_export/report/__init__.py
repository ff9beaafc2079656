"""The reports: renderers format result dataclasses and compute nothing.

``FORMATS`` is the registry of verify's report formats and ``BENCH_FORMATS`` that of
bench's, each written by ``--<name> FILE``: a new format is one module defining a
``ReportFormat`` (or ``BenchFormat``) and one line here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from attn_export._deps import require
from attn_export.artifacts.files import LOCK_NAME, append_output, output_target, resolved, write_output
from attn_export.artifacts.manifest import MANIFEST_NAME, is_build_folder
from attn_export.errors import AttnExportError, UsageError
from attn_export.report import bench_text, benchmark_json, json_report, junit, markdown, plot
from attn_export.report.base import BenchFormat, ReportFormat

if TYPE_CHECKING:
    from attn_export.pipelines.bench.results import BenchReport, DecodeBenchReport
    from attn_export.pipelines.verify import VerifyReport

__all__ = [
    "BENCH_FORMATS",
    "FORMATS",
    "BenchFormat",
    "ReportFormat",
    "build_files",
    "folder_graphs",
    "graph_data",
    "check_bench_formats",
    "check_report_paths",
    "check_reports_spare",
    "write_bench_reports",
    "write_reports",
]

FORMATS: dict[str, ReportFormat] = {
    json_report.FORMAT.name: json_report.FORMAT,
    junit.FORMAT.name: junit.FORMAT,
    markdown.FORMAT.name: markdown.FORMAT,
}

BENCH_FORMATS: dict[str, BenchFormat] = {
    json_report.BENCH_FORMAT.name: json_report.BENCH_FORMAT,
    bench_text.BENCH_FORMAT.name: bench_text.BENCH_FORMAT,
    plot.BENCH_FORMAT.name: plot.BENCH_FORMAT,
    benchmark_json.BENCH_FORMAT.name: benchmark_json.BENCH_FORMAT,
}


#: Paths that are not UTF-8 (a folder named in another encoding) reach the reports as
#: lone surrogates; they are written as ``\udcff`` escapes instead of failing the write.
_ERRORS = "backslashreplace"


def write_reports(report: VerifyReport, paths: Mapping[str, Path | None]) -> None:
    """Write each requested format atomically, and append the Markdown report to
    ``$GITHUB_STEP_SUMMARY`` when it is set."""
    for name, path in paths.items():
        if path is not None:
            write_output(path, FORMATS[name].render(report).encode("utf-8", _ERRORS))
    summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_file:
        try:
            append_output(Path(summary_file), markdown.markdown_report(report), _ERRORS)
        except UsageError as e:
            raise UsageError(f"$GITHUB_STEP_SUMMARY: {e}") from e


#: The suffixes no report is written to, and whose they are: the files a build folder, a
#: checkout or a bundle holds.
_NOT_REPORTS = {".onnx": "an ONNX graph's", ".npz": "a golden file's", ".toml": "a spec's", ".py": "Python source's"}


def check_report_paths(
    paths: Mapping[str, Path | None],
    made: Path | None = None,
    reads: Iterable[Path] = (),
    summary: bool = True,
    into_builds: bool = True,
) -> None:
    """Refuse, before any work, a report path that is not a regular file or a new path
    (``artifacts.files.output_target``), and ``$GITHUB_STEP_SUMMARY`` likewise where the
    command appends to it (``summary``); one whose folder does not exist, unless it is in
    ``made``, the folder the command makes (found after the work, its report was lost); a
    file another report is written to, a file the command ``reads`` (a manifest, the
    reports it merges), any build folder's manifest or lock (without ``into_builds``, any
    path inside a build folder: a command that reads none writes none), and a graph, golden
    file, spec or module: written over, the run passes and what it read is gone."""
    summary_file = os.environ.get("GITHUB_STEP_SUMMARY") if summary else None
    given = [(f"--{flag}", path) for flag, path in paths.items()]
    read = {resolved(p) for p in reads}
    taken: dict[Path, str] = {}
    for label, path in [*given, ("$GITHUB_STEP_SUMMARY", Path(summary_file) if summary_file else None)]:
        if path is None:
            continue
        try:
            target = resolved(output_target(path))
        except UsageError as e:
            raise UsageError(f"$GITHUB_STEP_SUMMARY: {e}" if label[0] == "$" else str(e)) from None
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
        if target in build_files(target.parent) and is_build_folder(target.parent):
            raise UsageError(
                f"{label} {path} is {target.name} of the build folder {target.parent}; write the report elsewhere"
            )
        build = None if into_builds else next((f for f in target.parents if is_build_folder(f)), None)
        if build is not None:
            raise UsageError(f"{label} {path} is inside the build folder {build}; write the report elsewhere")
        if whose := _NOT_REPORTS.get(target.suffix.lower()):
            raise UsageError(f"{label} {path}: {target.suffix} is {whose} suffix, not a report's; write it elsewhere")


def _probe(path: Path, folder: Path) -> None:
    """A report is written through a temporary file in its folder (``atomic_write``): a
    folder that takes none (read-only, ``/proc``) is refused before the work, not after it."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def check_reports_spare(paths: Mapping[str, Path | None], folder: Path, names: Iterable[str]) -> None:
    """Refuse a report path that is one of the files ``names`` of the build folder being read
    (its manifest, a graph, a golden file): written over it, the run passes and the folder
    is broken for the next."""
    kept = {resolved(folder / name): name for name in names}
    for flag, path in paths.items():
        if path is not None and (hit := kept.get(resolved(output_target(path)))) is not None:
            raise UsageError(f"--{flag} {path} is {hit} of the build folder {folder}; write the report elsewhere")


def check_bench_formats(paths: Mapping[str, Path | None], made: Path | None = None) -> None:
    """Refuse, before anything is timed, a requested format whose package is missing or
    whose path cannot take a report (in ``made``, the build folder bench makes, it can;
    not over its manifest)."""
    for name, path in paths.items():
        fmt = BENCH_FORMATS[name]
        if path is not None and fmt.suffixes and path.suffix.lower() not in fmt.suffixes:
            raise UsageError(f"--{name} {path}: write a {', '.join(fmt.suffixes)} file (the suffix picks the format)")
        if path is not None and fmt.requires:
            require(fmt.requires, f"--{name}")
    check_report_paths(paths, made, reads=build_files(made) if made else (), summary=False)


def build_files(folder: Path) -> list[Path]:
    """The files of a build folder no report may be written over that the suffixes do not
    already name: its manifest and its lock (and its graphs' data: ``graph_data``)."""
    return [folder / MANIFEST_NAME, folder / LOCK_NAME]


def folder_graphs(folder: Path, names: Iterable[str] | None = None) -> list[Path]:
    """The graphs a build folder's manifest names (those of ``names``); none where it has
    no manifest that reads (the command itself says so)."""
    from attn_export.artifacts.manifest import load_manifest

    if not (folder / MANIFEST_NAME).is_file():
        return []
    try:
        models = load_manifest(folder).models
    except AttnExportError:
        return []
    return [folder / e.file for n, e in models.items() if names is None or n in names]


def graph_data(graphs: Iterable[Path]) -> list[Path]:
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


def write_bench_reports(report: BenchReport | DecodeBenchReport, paths: Mapping[str, Path | None]) -> None:
    """Write each requested bench format."""
    for name, path in paths.items():
        if path is not None:
            BENCH_FORMATS[name].write(report, path)
