"""attn-export list: the model specs, as a table or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import JsonTarget, json_option, models_option


@cli.command("list")
@click.argument("names", nargs=-1)
@models_option
@json_option("Write the specs as JSON to FILE (a .json file; - or a bare --json: stdout).", bare=True)
def list_cmd(names: tuple[str, ...], models_dir: Path, json_path: JsonTarget | None) -> None:
    """Show the model zoo (or NAMES: models or spec files): name, module, inputs with
    their dims, opset, exporter.

    Example:

    \b
        attn-export list --models models
        attn-export list path/to/model.toml
        attn-export list mha --json
    """
    from attn_export.model_spec import load_spec, spec_paths
    from attn_export.report.build_text import format_spec_table
    from attn_export.report.output_plan import OutputPlan

    plan = OutputPlan.make({"json": json_path})
    specs = [load_spec(p) for p in spec_paths(models_dir, names)]
    plan.echo(format_spec_table(specs))
    plan.write_texts({"json": lambda: json_text([s.to_dict() for s in specs])})
