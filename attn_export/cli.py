"""The command line: a thin layer over the library.

Every command turns the library's errors into one line on stderr and an exit code
(0 success, 1 a check failed, 2 bad usage or input); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from attn_export import __version__
from attn_export.errors import AttnExportError

__all__ = ["main"]


class _Group(click.Group):
    """Maps AttnExportError to a one-line message and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AttnExportError as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"Error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted; files already written are complete, nothing is half-written.", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="attn-export")
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
def cli(debug: bool) -> None:
    """Export PyTorch attention modules to ONNX and prove they run correctly in ONNX Runtime."""


models_option = click.option(
    "--models",
    "models_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("models"),
    show_default=True,
    help="Folder of *.toml model specs.",
)


@cli.command("list")
@models_option
@click.option("--json", "as_json", is_flag=True, help="Print the specs as JSON.")
def list_cmd(models_dir: Path, as_json: bool) -> None:
    """Show the model zoo: name, module, inputs with their dims, opset, exporter.

    Example:

        attn-export list --models models
    """
    from attn_export.report.build_text import format_spec_table
    from attn_export.spec import load_spec, spec_paths

    specs = [load_spec(p) for p in spec_paths(models_dir)]
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in specs], indent=2))
    else:
        click.echo(format_spec_table(specs))


@cli.command()
@click.argument("names", nargs=-1)
@models_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("build"),
              show_default=True, help="Output folder for .onnx files, golden vectors and manifest.json.")
@click.option("--opset", type=click.IntRange(7, 30), help="Override every spec's opset.")
@click.option("--exporter", type=click.Choice(["dynamo", "torchscript"]), help="Override every spec's exporter.")
@click.option("--force", is_flag=True, help="Rebuild models even when nothing changed.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first model that fails.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of progress lines.")
def build(
    names: tuple[str, ...],
    models_dir: Path,
    out_dir: Path,
    opset: int | None,
    exporter: str | None,
    force: bool,
    fail_fast: bool,
    as_json: bool,
) -> None:
    """Export the zoo (or NAMES) to ONNX with dynamic batch and sequence axes.

    Each model is exported in eval mode, checked (onnx.checker, symbolic and distinct
    dynamic axes), smoke-run in ONNX Runtime against PyTorch, and written atomically with
    golden vectors and a manifest entry. Unchanged models are skipped.

    Example:

        attn-export build --out build
        attn-export build mha mha_cross --force
    """
    from attn_export.build import BuildOptions, build_models
    from attn_export.report.build_text import format_build_line, format_build_summary
    from attn_export.spec import spec_paths

    paths = spec_paths(models_dir, names)
    on_result = None if as_json else (lambda r: click.echo(format_build_line(r)))
    summary = build_models(paths, BuildOptions(out_dir, opset, exporter, force, fail_fast), on_result)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        click.echo(format_build_summary(summary))
    for r in summary.results:
        if r.error and as_json:
            click.echo(f"Error: {r.error}", err=True)
    sys.exit(summary.exit_code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="attn-export")
