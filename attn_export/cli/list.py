"""attn-export list: the model specs, as a table or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import models_option


@cli.command("list")
@click.argument("names", nargs=-1)
@models_option
@click.option("--json", "as_json", is_flag=True, help="Print the specs as JSON.")
def list_cmd(names: tuple[str, ...], models_dir: Path, as_json: bool) -> None:
    """Show the model zoo (or NAMES: models or spec files): name, module, inputs with
    their dims, opset, exporter.

    Example:

    \b
        attn-export list --models models
        attn-export list path/to/model.toml
    """
    from attn_export.report.build_text import format_spec_table
    from attn_export.spec import load_spec, spec_paths

    specs = [load_spec(p) for p in spec_paths(models_dir, names)]
    if as_json:
        click.echo(json_text([s.to_dict() for s in specs], end=""))
    else:
        click.echo(format_spec_table(specs))
