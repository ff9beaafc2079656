"""The group every command hangs on, and the mapping of errors to one line and an exit code
(0 success, 1 a check failed, 2 bad usage or input, 3 a bug); ``--debug`` shows the traceback."""

from __future__ import annotations

import io
import sys
from typing import Any

import click

from attn_export import __version__
from attn_export.errors import AttnExportError, first_line

__all__ = ["INTERNAL_ERROR", "cli", "main"]

#: The exit code of an error attn-export did not raise on purpose (a bug).
INTERNAL_ERROR = 3


class _Group(click.Group):
    """Maps AttnExportError to a one-line message and its exit code, and any other
    exception (a bug) to one line and ``INTERNAL_ERROR``."""

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
        except click.NoSuchOption as e:
            if e.option_name != "--debug":
                raise
            hint = f"{e.message} (--debug goes before the command: attn-export --debug COMMAND ...)"
            raise click.NoSuchOption(e.option_name, hint, e.possibilities, e.ctx) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - a bug, here or in a library: one line, exit 3
            if ctx.params.get("debug"):
                raise
            click.echo(
                f"Error: internal error ({type(e).__name__}: {first_line(e)}); attn-export --debug shows the "
                "traceback: please report it",
                err=True,
            )
            ctx.exit(INTERNAL_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="attn-export")
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
def cli(debug: bool) -> None:
    """Export PyTorch attention modules to ONNX and prove they run correctly in ONNX Runtime."""
    # A path that is not UTF-8 reaches us as lone surrogates; print its original bytes, as
    # ls does, instead of failing mid-report (PYTHONIOENCODING=utf-8 makes that strict).
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="surrogateescape")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="attn-export")
