"""attn-export build: export, check and smoke-test each spec into a build folder."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.artifacts.targets import TARGETS as BUILD_TARGETS
from attn_export.cli.group import cli
from attn_export.cli.options import (
    JsonTarget,
    executor_options,
    flag_names,
    json_option,
    max_memory_option,
    models_option,
    notice,
    out_option,
    provider_option,
    variant_option,
    wait_option,
)
from attn_export.model_spec import EXPORTERS


@cli.command()
@click.argument("names", nargs=-1)
@models_option
@out_option("Output folder for .onnx files, golden vectors and manifest.json.")
@click.option("--opset", type=click.IntRange(7, 30), help="Override every spec's opset.")
@click.option("--exporter", type=click.Choice(EXPORTERS), help="Override every spec's exporter.")
@click.option("--force", is_flag=True, help="Rebuild models even when nothing changed.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first model that fails.")
@variant_option(
    "Graph variant to build (repeatable). Default: fp32. 'auto' times the candidates "
    "at the spec's typical shape and keeps the fastest within tolerance."
)
@provider_option(
    "Provider that ort-optimized optimizes for, auto times on and --target genai's genai_config.json names."
)
@wait_option
@max_memory_option
@click.option(
    "--record-intermediates",
    is_flag=True,
    help="Also record PyTorch's value of every FX node on the smallest golden case, so that "
    "'localize --golden' runs where torch is not installed.",
)
@click.option(
    "--target",
    type=click.Choice(list(BUILD_TARGETS)),
    default="onnx",
    show_default=True,
    help="What the folder is for: " + "; ".join(f"{k}: {v}" for k, v in BUILD_TARGETS.items()) + ".",
)
@executor_options
@json_option(
    "Write a JSON summary to FILE (a .json file; - or a bare --json: stdout, instead of progress lines).", bare=True
)
def build(
    names: tuple[str, ...],
    models_dir: Path,
    out_dir: Path,
    opset: int | None,
    exporter: str | None,
    force: bool,
    fail_fast: bool,
    variants: tuple[str, ...],
    provider: str,
    wait_s: float,
    max_memory: int | None,
    record_intermediates: bool,
    target: str,
    executor: str,
    jobs: int | None,
    json_path: JsonTarget | None,
) -> None:
    """Export the zoo (or NAMES: models in --models, or spec files) to ONNX with dynamic
    batch and sequence axes.

    Each model is exported in eval mode, checked (onnx.checker, symbolic and distinct
    dynamic axes), smoke-run in ONNX Runtime against PyTorch, and written atomically with
    golden vectors and a manifest entry. Unchanged models are skipped.

    Example:

    \b
        attn-export build --out build
        attn-export build mha mha_cross --force
        attn-export build path/to/model.toml
        attn-export build mha --variant fp32 --variant int8 --variant auto
        attn-export build mha --record-intermediates
        attn-export build --jobs auto
        attn-export build llama_causal_lm --target genai
    """
    from attn_export.executors import Parallelism
    from attn_export.model_spec import spec_paths
    from attn_export.pipelines.building import BuildOptions, build_models
    from attn_export.report.build_text import format_build_line, format_build_summary, traceback_lines
    from attn_export.report.output_plan import OutputPlan, folder_graphs

    options = BuildOptions(
        out_dir=out_dir,
        opset=opset,
        exporter=exporter,
        force=force,
        fail_fast=fail_fast,
        variants=tuple(dict.fromkeys(variants or ("fp32",))),
        provider=provider,
        lock_wait_s=wait_s,
        max_memory=max_memory,
        record_intermediates=record_intermediates,
        target=target,
        debug=bool(click.get_current_context().find_root().params.get("debug")),
    )
    plan = OutputPlan.make({"json": json_path}, graphs=folder_graphs(out_dir), build=out_dir, made=out_dir)
    on_result = None if plan.to_stdout else (lambda r: click.echo(format_build_line(r)))
    with flag_names(lock_wait_s="--wait"):
        parallelism = Parallelism(executor, jobs)
        summary = build_models(spec_paths(models_dir, names), options, on_result, notice, parallelism)
    plan.write_texts({"json": lambda: json_text(summary.to_dict())})
    if plan.to_stdout:  # the errors the progress lines would have shown
        for r in summary.results:
            if r.error:
                click.echo(f"Error: {r.error}{traceback_lines(r)}", err=True)
    else:
        click.echo(format_build_summary(summary))
    sys.exit(summary.exit_code)
