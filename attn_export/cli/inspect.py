"""attn-export inspect: what any ONNX file holds."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import JsonTarget, PathArg, json_option, provider_option


@cli.command("inspect")
@click.argument("file", type=PathArg())
@provider_option("Check that every op has a kernel on this ONNX Runtime provider.")
@json_option(
    "Write the description as JSON to FILE (a .json file; - or a bare --json: stdout, instead of text).", bare=True
)
def inspect_cmd(file: Path, provider: str, json_path: JsonTarget | None) -> None:
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
    from attn_export.report.output_plan import OutputPlan

    plan = OutputPlan.make({"json": json_path}, reads=[file], graphs=[file])
    result = inspect_file(file, provider)
    plan.echo(format_inspect(result))
    plan.write_texts({"json": lambda: json_text(result.to_dict())})
    sys.exit(0 if result.kernels_ok else 1)
