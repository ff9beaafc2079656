"""attn-export inspect: what any ONNX file holds."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import PathArg, provider_option


@cli.command("inspect")
@click.argument("file", type=PathArg())
@provider_option("Check that every op has a kernel on this ONNX Runtime provider.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect_cmd(file: Path, provider: str, as_json: bool) -> None:
    """Describe any ONNX file: IR version, opsets, producer, metadata, inputs and outputs
    with symbolic dims, op histogram, parameters, external data, and whether every op has
    a kernel on the provider (exit 1 if not).

    External data pointing outside the file's folder is refused, never read.

    Example:

    \b
        attn-export inspect build/mha.onnx --json
    """
    from attn_export.pipelines.inspect import inspect_file
    from attn_export.report.inspect_text import format_inspect

    result = inspect_file(file, provider)
    click.echo(json_text(result.to_dict(), end="") if as_json else format_inspect(result))
    sys.exit(0 if result.kernels_ok else 1)
