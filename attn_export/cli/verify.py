"""attn-export verify: built graphs against PyTorch or golden vectors across a shape sweep."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from attn_export.cli.group import cli
from attn_export.cli.options import (
    FILE,
    MAX_SLOWDOWN,
    FiniteFloat,
    JsonTarget,
    PathArg,
    checkout_models_option,
    executor_options,
    flag_names,
    format_targets,
    given,
    max_memory_option,
    notice,
    outside_graph_options,
    report_options,
    threads_option,
    timeout_option,
    wait_option,
)
from attn_export.errors import AttnExportError
from attn_export.model_spec.distributions import DISTRIBUTIONS
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.scenarios import SCENARIOS
from attn_export.report import FORMATS
from attn_export.runtimes import PROVIDERS, RUNTIMES
from attn_export.runtimes.target import DEFAULT_RUNTIME

if TYPE_CHECKING:
    from attn_export.artifacts.manifest import Manifest


def _unbuilt_notice(models_dir: Path, manifest: Manifest, out_dir: Path) -> None:
    """Say which checkout specs the build folder has no graph of: a verify of the whole
    folder passes over the models it holds, and a spec left unbuilt is not among them."""
    built = {entry.model_spec.name for entry in manifest.models.values()}
    unbuilt = sorted(p.stem for p in models_dir.glob("*.toml") if p.stem not in built) if models_dir.is_dir() else []
    if unbuilt:
        listed = ", ".join(unbuilt[:5]) + (", ..." if len(unbuilt) > 5 else "")
        some = f"{len(unbuilt)} specs in {models_dir} have" if len(unbuilt) > 1 else f"a spec in {models_dir} has"
        notice(f"{some} no graph in {out_dir}, so not verified: {listed}")


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    from attn_export.pipelines.verify.models import parse_shard

    try:
        return None if value is None else parse_shard(value)
    except AttnExportError as e:
        raise click.BadParameter(str(e)) from e


@cli.command()
@click.argument("paths", nargs=-1, type=PathArg())
@checkout_models_option
@outside_graph_options
@click.option(
    "--provider",
    "providers",
    multiple=True,
    type=click.Choice([*PROVIDERS, "all"]),
    help="ONNX Runtime execution provider (repeatable; 'all' = every one installed). Default: cpu.",
)
@click.option(
    "--runtime",
    "runtimes",
    multiple=True,
    type=click.Choice(list(RUNTIMES)),
    help="Runtime to check (repeatable): " + "; ".join(f"{k.name}: {k.help}" for k in RUNTIMES.values()) + ".",
)
@click.option("--golden", is_flag=True, help="Compare with the recorded golden vectors; needs no torch.")
@click.option(
    "--shapes", help='Shape points instead of the sweep, e.g. "batch=1,seq=3,kv_seq=9;batch=2,seq=5,kv_seq=7".'
)
@click.option(
    "--distribution",
    "distributions",
    multiple=True,
    type=click.Choice(list(DISTRIBUTIONS)),
    help="Value distribution of float inputs, at every shape (repeatable). Default: "
    + ", ".join(f"{k} ({v[1]})" for k, v in DISTRIBUTIONS.items())
    + "; unit normal at every shape, the others at the distinct and largest shapes.",
)
@click.option(
    "--inputs",
    "inputs_file",
    type=FILE,
    help="Verify with recorded inputs from this .npz (keys '<input>' for one case, or "
    "'<case>/inputs/<input>'; golden mode also needs '<case>/outputs/<output>').",
)
@click.option(
    "--random",
    "n_random",
    type=click.IntRange(0, 100),
    default=2,
    show_default=True,
    help="Seeded random shape points added to the sweep.",
)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed for inputs and random shapes.")
@click.option(
    "--mask-case",
    type=click.Choice(CASES),
    help="With --shapes: feed this named mask case instead of the mask's pattern (as reproduce commands do).",
)
@click.option(
    "--decode",
    "decode_steps",
    type=click.IntRange(0, 4096),
    help="Decode steps after the prompt for models with a KV cache, both sides feeding back their own "
    "presents (default 8; 0 skips; off by default with --shapes, --distribution or --inputs).",
)
@click.option(
    "--generate",
    "generate_steps",
    type=click.IntRange(0, 4096),
    default=0,
    help="Greedy tokens each causal LM (a logits output and a KV cache) generates from seeded prompts, at "
    "batch 1 and a padded batch: PyTorch's generate() against the graph run token by token (and in "
    "onnxruntime-genai's generator where it is installed); tokens must match, logits within tolerance.",
)
@click.option(
    "--atol",
    type=FiniteFloat(0),
    help="Override every output's absolute tolerance (a lossy variant's share of the output's rms too).",
)
@click.option("--rtol", type=FiniteFloat(0), help="Override every output's relative tolerance.")
@threads_option("Threads for both PyTorch and ONNX Runtime.")
@click.option("--no-latency", is_flag=True, help="Skip timing.")
@click.option(
    "--latency-budget",
    type=FiniteFloat(0.001),
    default=0.05,
    show_default=True,
    help="Seconds of timed repeats per side and shape.",
)
@click.option(
    "--max-slowdown",
    type=MAX_SLOWDOWN,
    help="Fail when ONNX Runtime's p50 exceeds R x PyTorch's.",
)
@click.option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    help="For decoders: a scenario preset's steps instead of the sweep ("
    + "; ".join(f"{s.name}: {s.help}" for s in SCENARIOS.values())
    + "). Models without a key/value cache are left out.",
)
@click.option(
    "--require-placement/--no-require-placement",
    default=None,
    help="Fail a target's cases when ONNX Runtime ran nodes that handle float data on another provider than "
    "the one asked for (read from one profiled run per model and target, never a timed one). "
    "Default: on for every provider but cpu.",
)
@max_memory_option
@wait_option
@report_options
@click.option(
    "--shard",
    callback=_shard,
    help="Verify only shard i of n (1-based), e.g. 1/3 (attn-export report merge puts their JSON reports together).",
)
@executor_options
@click.option(
    "--localize",
    "localize_first",
    is_flag=True,
    help="Localize the first failing case of each model (attn-export localize) and print where the graph "
    "leaves PyTorch under the failures.",
)
@click.option(
    "--check-regions",
    is_flag=True,
    help="For each graph that passes, localize its first case and add a note naming any region (and source "
    "line) whose own error breaks its tolerance though the outputs agree; the graph still passes.",
)
@click.option(
    "--strict-regions",
    is_flag=True,
    help="As --check-regions, but such a graph fails, the region named in its failure reason.",
)
@timeout_option(
    "--region-timeout",
    "Stop a run on ONNX Runtime (or onnx.reference) after this many seconds: of a graph holding a Loop, "
    "each case's (a case stopped fails, and its graph's later cases are not run); with --check-regions, "
    "--strict-regions or "
    "--localize, also of the whole graph or of one region (a region over it fails its graph, --check-regions "
    "too, or is not localized).",
)
def verify(
    paths: tuple[Path, ...],
    models_dir: Path,
    spec_path: Path | None,
    variant: str,
    providers: tuple[str, ...],
    runtimes: tuple[str, ...],
    golden: bool,
    shapes: str | None,
    distributions: tuple[str, ...],
    inputs_file: Path | None,
    n_random: int,
    seed: int,
    mask_case: str | None,
    decode_steps: int | None,
    generate_steps: int,
    atol: float | None,
    rtol: float | None,
    threads: int | None,
    no_latency: bool,
    latency_budget: float,
    max_slowdown: float | None,
    scenario: str | None,
    require_placement: bool | None,
    max_memory: int | None,
    wait_s: float,
    shard: tuple[int, int] | None,
    executor: str,
    jobs: int | None,
    localize_first: bool,
    check_regions: bool,
    strict_regions: bool,
    timeout_s: float,
    **reports: JsonTarget | None,
) -> None:
    """Check built graphs against PyTorch (or golden vectors) across a shape sweep.

    PATHS is a build folder (default: build) or .onnx files from one. Each artifact's
    sha256 is checked against the manifest, its dynamic axes against the graph, and its
    outputs against the PyTorch original at batch 1, sequence 1, unequal query and kv
    lengths, the longest allowed lengths and seeded random shapes. With --spec, PATHS is
    one .onnx file no build made, checked the same way against that spec. Exit 0 when all
    agree, 1 on any mismatch or failed gate, 2 on bad usage or input.

    Example:

    \b
        attn-export verify build --json report.json --junit junit.xml
        attn-export verify build --golden --no-latency
        attn-export verify build/mha.onnx --shapes "batch=1,seq=1" --seed 3
        attn-export verify edited/mha.onnx --spec models/mha.toml
        attn-export verify build/llama_causal_lm.onnx --generate 16
        attn-export verify build/bert_attention.int8.onnx --strict-regions
    """
    from attn_export.artifacts.folder import tidy
    from attn_export.executors import Parallelism
    from attn_export.model_spec.shapes import parse_shapes
    from attn_export.pipelines.verify import (
        CaseResult,
        ModelCheck,
        Shard,
        VerifyOptions,
        decoder_names,
        select_models,
        shard_names,
        verify_artifacts,
    )
    from attn_export.report import write_reports
    from attn_export.report.output_plan import OutputPlan
    from attn_export.report.verify_text import (
        VERIFY_WIDTHS,
        format_decode,
        format_distributions,
        format_failures,
        format_generate,
        format_model_rows,
        format_placement,
        format_summary,
        header,
    )
    from attn_export.runtimes import resolve_targets

    if localize_first and golden:
        raise click.UsageError("--localize compares with PyTorch: it cannot be combined with --golden")
    regions = "strict" if strict_regions else "check" if check_regions else None
    named = {"regions": f"--{regions}-regions"} if regions else {}  # the flag given, where one was
    with flag_names(**named, spec_file="--spec", region_timeout_s="--region-timeout"):
        options = VerifyOptions(
            targets=resolve_targets(runtimes or (DEFAULT_RUNTIME,), providers or ("cpu",)),
            models_dir=models_dir,
            golden=golden,
            golden_checkout=golden and given("models_dir"),
            shapes=parse_shapes(shapes) if shapes else None,
            distributions=distributions or None,
            inputs_file=inputs_file,
            n_random=n_random,
            seed=seed,
            atol=atol,
            rtol=rtol,
            latency=not no_latency,
            threads=threads,
            latency_budget_s=latency_budget,
            max_slowdown=max_slowdown,
            max_memory=max_memory,
            lock_wait_s=wait_s,
            mask_case=mask_case,
            decode_steps=decode_steps,
            generate_steps=generate_steps,
            require_placement=require_placement,
            scenario=scenario,
            spec_file=spec_path,
            variant=variant,
            regions=regions,
            region_timeout_s=timeout_s,
        )
        options.check()  # before the folder is read
        parallelism = Parallelism(executor, jobs)
        out_dir, manifest, names = select_models(list(paths) or [Path("build")], spec_path, variant)
        plan = OutputPlan.make(
            format_targets(FORMATS, "report_", reports),
            graphs=[out_dir / manifest.models[n].file for n in names],
            build=out_dir,
            build_files=[f for e in manifest.models.values() for f, _ in e.files()],
            summary=True,
        )
        whole = not golden and spec_path is None and all(p.is_dir() for p in paths)
        if scenario:
            names = decoder_names(manifest, names, scenario, notice)
        selected, names = names, shard_names(names, shard)
        tidied = tidy(out_dir) if spec_path is None else None  # a graph's own folder is no build's to tidy
        if tidied:
            notice(tidied)
        if not names and not shard:
            click.echo("no model to verify", err=plan.to_stdout)  # no report: stdout holds no JSON
            return
        printed: dict[str, int] = {}  # each model's notes printed with its rows
        w = VERIFY_WIDTHS.fitting(
            [(n, manifest.models[n].model_spec) for n in names], [t.label for t in options.targets]
        )

        def on_model(name: str, cases: list[CaseResult], check: ModelCheck) -> None:
            if not printed:  # the header only once a model has rows: an error stays one line
                plan.echo(header(w))
            printed[name] = len(check.notes)
            plan.echo(format_model_rows(name, cases, check, w))

        report = verify_artifacts(out_dir, manifest, names, options, on_model, notice, parallelism, selected)
        if shard:
            report.shard = Shard.of(selected, shard)
            if not names:  # its reports still say which shard it was, for report merge
                plan.echo(f"shard {shard[0]}/{shard[1]} holds no model")
                write_reports(report, plan)
                return
        for check in report.checks:  # what the region check noted once the rows were out
            for note in check.notes[printed.get(check.model, 0) :]:
                plan.echo(f"note: {note}")
        sections = (format_decode, format_generate, format_distributions, format_placement, format_failures)
        for text in (section(report) for section in sections):
            if text:
                plan.echo(text)
        if localize_first:
            from attn_export.pipelines.localize import localize_failures
            from attn_export.report.localize_text import format_localize

            for found in localize_failures(report, options, notice):
                plan.echo(format_localize(found))
        plan.echo(format_summary(report))
        if whole:
            _unbuilt_notice(models_dir, manifest, out_dir)
        write_reports(report, plan)
        sys.exit(report.exit_code)
