"""attn-export report: work with the reports verify writes (merge a sharded run's)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.cli.group import cli
from attn_export.cli.options import FILE, JsonTarget, format_targets, report_options
from attn_export.report import FORMATS


@cli.group("report")
def report_group() -> None:
    """Work with the reports verify writes."""


@report_group.command("merge")
@click.argument("files", nargs=-1, required=True, type=FILE)
@report_options
def report_merge(files: tuple[Path, ...], **reports: JsonTarget | None) -> None:
    """Put the JSON reports of a sharded verify (each shard's --shard i/n --json FILE)
    together: the reports one unsharded run would give, the same JSON apart from timings.

    Shards of different builds, seeds, options or versions, a shard missing or given twice,
    are refused in one line (exit 2). Exit 0 when the merged run passed, 1 when it failed.

    Example:

    \b
        attn-export report merge shard-*.json --junit junit.xml --markdown verify.md --json verify.json
    """
    from attn_export.pipelines.verify.merge import merge_shards
    from attn_export.report import write_reports
    from attn_export.report.json_report import read_json_report
    from attn_export.report.output_plan import OutputPlan
    from attn_export.report.verify_text import format_failures, format_summary

    plan = OutputPlan.make(format_targets(FORMATS, "report_", reports), reads=files, summary=True, into_builds=False)
    report = merge_shards([(str(f), read_json_report(f)) for f in files])
    for text in (format_failures(report), format_summary(report)):
        if text:
            plan.echo(text)
    write_reports(report, plan)
    sys.exit(report.exit_code)
