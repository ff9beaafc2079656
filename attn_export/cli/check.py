"""attn-export check: the static checks, for a pre-commit hook."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import JsonTarget, PathArg, flag_names, json_option


@cli.command("check")
@click.argument("paths", nargs=-1, required=True, type=PathArg())
@click.option(
    "--min-opset", type=click.IntRange(1), default=7, show_default=True, help="Lowest default-domain opset allowed."
)
@click.option(
    "--max-opset",
    type=click.IntRange(1),
    help="Highest default-domain opset allowed. Default: the newest onnx defines.",
)
@click.option(
    "--allow-domain",
    "domains",
    multiple=True,
    help="Operator domain allowed besides ai.onnx, ai.onnx.ml and com.microsoft (repeatable).",
)
@json_option("Write the report as JSON to FILE (-: stdout, instead of text).")
def check_cmd(
    paths: tuple[Path, ...],
    min_opset: int,
    max_opset: int | None,
    domains: tuple[str, ...],
    json_path: JsonTarget | None,
) -> None:
    """The static checks, for a pre-commit hook: nothing runs, nothing imports torch.

    PATHS are .onnx files, golden files, manifest.json files or build folders. Each graph
    is held to onnx.checker (full check), no random op, its opset and operator domains on
    the allow-list, and named dims; a graph its folder's manifest names also to the
    manifest's sha256 of it and its golden file, and to the spec's dynamic axes (symbolic,
    distinct, named as the spec names them). Exit 0 when every file passes, 1 when one
    does not, 2 on bad usage.

    Example:

    \b
        attn-export check build
        attn-export check build/mha.onnx exported/model.onnx --max-opset 21
        attn-export check build --json -
    """
    from attn_export.exporter.graph_checks import DEFAULT_DOMAINS
    from attn_export.pipelines.check import CheckOptions, check_paths
    from attn_export.report.check_text import format_check
    from attn_export.report.output_plan import OutputPlan, folder_graphs

    graphs = (g for p in paths for g in (folder_graphs(p) if p.is_dir() else [p]))  # read if a report asks
    plan = OutputPlan.make(
        {"json": json_path},
        reads=paths,
        graphs=(g for g in graphs if g.suffix == ".onnx" and g.is_file()),
        read_builds={p if p.is_dir() else p.parent for p in paths},
    )
    options = CheckOptions(min_opset, max_opset, tuple(dict.fromkeys((*DEFAULT_DOMAINS, *domains))))
    with flag_names():
        report = check_paths(paths, options)
    plan.echo(format_check(report))
    plan.write_texts({"json": lambda: json_text(report.to_dict())})
    sys.exit(report.exit_code)
