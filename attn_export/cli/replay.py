"""attn-export replay: rerun a replay bundle's region."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.cli.group import cli
from attn_export.cli.options import PathArg, max_memory_option, provider_option, timeout_option


@cli.command()
@click.argument("folder", type=PathArg(file_okay=False))
@provider_option("ONNX Runtime provider to rerun the region on.")
@max_memory_option
@timeout_option("--timeout", "Stop the region's run after this many seconds (a Loop without end), an exit 1.")
def replay(folder: Path, provider: str, max_memory: int | None, timeout_s: float) -> None:
    """Rerun a replay bundle (localize --bundle): the blamed region's nodes on the inputs
    PyTorch gave them, against PyTorch's recorded value. Needs neither torch nor the build
    folder. Exit 0 when they agree, 1 when they differ, 2 on a bad bundle.

    Example:

    \b
        attn-export replay where/
        sh where/reproduce.sh --provider cuda
    """
    from attn_export.pipelines.localize import replay_bundle
    from attn_export.report.localize_text import format_replay

    result = replay_bundle(folder, provider, max_memory, timeout_s)
    click.echo(format_replay(result))
    sys.exit(0 if result.passed else 1)
