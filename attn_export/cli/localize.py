"""attn-export localize: the first node where a graph leaves PyTorch on one case."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from pathlib import Path

import click

from attn_export.artifacts.json_text import json_text
from attn_export.cli.group import cli
from attn_export.cli.options import (
    FILE,
    JsonTarget,
    PathArg,
    checkout_models_option,
    flag_names,
    given,
    json_option,
    max_memory_option,
    outside_graph_options,
    timeout_option,
    wait_option,
)
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.distributions import DISTRIBUTIONS
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.model import FULLY_MASKED
from attn_export.runtimes import PROVIDERS, RUNTIMES


@cli.command()
@click.argument("folder", type=PathArg())
@click.argument("model", required=False)
@checkout_models_option
@outside_graph_options
@click.option("--shapes", help="The case's sizes, e.g. \"batch=2,seq=5,kv_seq=7\" (default: the build's example).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed of the case's inputs.")
@click.option(
    "--distribution",
    type=click.Choice(list(DISTRIBUTIONS)),
    default=DEFAULT_DISTRIBUTION,
    show_default=True,
    help="Value distribution of float inputs.",
)
@click.option("--mask-case", type=click.Choice(CASES), help="Feed this named mask case instead of the pattern.")
@click.option(
    "--decode-step",
    type=click.IntRange(1),
    help="For a decoder: localize this step of verify --decode (1 = the prompt), fed the cache PyTorch's "
    "steps before it gave back.",
)
@click.option(
    "--generate-step",
    type=click.IntRange(1),
    help="For a causal LM: localize this step of verify --generate N's generation (1 = the prompt), fed "
    "PyTorch's own tokens and cache before it (give --generate N).",
)
@click.option(
    "--generate",
    "generate_steps",
    type=click.IntRange(1, 4096),
    help="With --generate-step: the N of the verify --generate N run (its seeded prompts depend on it).",
)
@click.option(
    "--layout",
    help="With --decode-step: the trajectory's padding layout (batch-1, left-padded, or full-batch where "
    "the mask takes no padding); with --generate-step: the generation's (batch-1, padded, same-length). "
    "Default: the first.",
)
@click.option(
    "--decode-steps",
    type=click.IntRange(0, 4096),
    default=8,
    show_default=True,
    help="With --decode-step: the steps verify --decode played (its --decode N); its tokens depend on it.",
)
@click.option(
    "--fully-masked",
    type=click.Choice(FULLY_MASKED),
    help="Override the spec's fully_masked for this case: match judges the padded query rows that ignore "
    "leaves out (in every region where the outputs differ on them), to see where the two sides part there.",
)
@click.option(
    "--runtime",
    type=click.Choice(list(RUNTIMES)),
    default="onnxruntime",
    show_default=True,
    help="Where the graph runs: ONNX Runtime on --provider, or the ONNX reference evaluator (onnx-reference).",
)
@click.option(
    "--provider", type=click.Choice(PROVIDERS), default="cpu", show_default=True, help="ONNX Runtime provider."
)
@click.option(
    "--shrink",
    is_flag=True,
    help="Search for the smallest case that fails at the same place (each dim toward its minimum, the mask "
    "case dropped) and localize that one.",
)
@click.option(
    "--bundle",
    type=PathArg(file_okay=False),
    help="Write a replay bundle of the blamed region into this new folder (attn-export replay reruns it).",
)
@json_option("Write the report as JSON to FILE (-: stdout, instead of text).")
@click.option(
    "--overlay",
    "overlay_path",
    type=FILE,
    help="Write a Model Explorer node-data overlay: each region's own error over its tolerance.",
)
@click.option(
    "--golden",
    is_flag=True,
    help="Localize the case 'build --record-intermediates' recorded, on PyTorch's recorded values: needs "
    "neither torch nor the models' code (a deploy box).",
)
@click.option(
    "--from",
    "golden_from",
    type=PathArg(file_okay=False),
    help="With --golden and --spec: the build folder whose recorded intermediates of the spec's graph (of "
    "--variant) the graph given (an edited copy) is paired with, by the FX nodes its values are named for.",
)
@click.option(
    "--strict-regions",
    is_flag=True,
    help="Exit 1 also where the outputs agree but a region's own error breaks its tolerance (a fault the "
    "outputs' tolerance hides; reported either way).",
)
@max_memory_option
@wait_option
@timeout_option(
    "--timeout",
    "Stop a run of the whole graph (noted; its regions still run) or of one region (an exit 1 naming it) "
    "after this many seconds on ONNX Runtime: a Loop without end ran until it was killed.",
)
def localize(
    folder: Path,
    model: str | None,
    models_dir: Path,
    spec_path: Path | None,
    variant: str,
    shapes: str | None,
    seed: int,
    distribution: str,
    mask_case: str | None,
    decode_step: int | None,
    generate_step: int | None,
    generate_steps: int | None,
    layout: str | None,
    decode_steps: int,
    fully_masked: str | None,
    runtime: str,
    provider: str,
    shrink: bool,
    bundle: Path | None,
    json_path: JsonTarget | None,
    overlay_path: Path | None,
    golden: bool,
    golden_from: Path | None,
    strict_regions: bool,
    max_memory: int | None,
    wait_s: float,
    timeout_s: float,
) -> None:
    """Name the first node where a built graph leaves PyTorch on one case, with the FX
    node, module and source line it came from. FOLDER is a build folder, or with --spec
    one .onnx file no build made.

    Both sides run once with every intermediate value kept; then each group of ONNX nodes
    made from one FX node runs alone on PyTorch's values, so its own error is told apart
    from what it inherits. The case is verify's (its reproduce line gives --shapes, --seed,
    --distribution, --mask-case). Where the outputs agree but a region's own error breaks
    its tolerance all the same, it says so ("OUTPUTS AGREE, but region ..."). Exit 0 when
    the case agrees (with --strict-regions: and no region breaks its tolerance), 1 when the
    graph diverges (or, with --strict-regions, such a region), 2 on bad usage or input.

    Example:

    \b
        attn-export localize build mha --shapes "batch=2,seq=5,kv_seq=7" --seed 3
        attn-export localize build llama_attention --json where.json
        attn-export localize build mha --shapes "batch=8,seq=100" --shrink --bundle where/
        attn-export localize build mha_kv_cache --decode-step 3 --layout left-padded
        attn-export localize build mha --golden
        attn-export localize build bert_attention.int8 --strict-regions
        attn-export localize build mha --runtime onnx-reference
        attn-export localize edited/mha.onnx --spec models/mha.toml --shapes "batch=2,seq=5,kv_seq=7"
        attn-export localize edited/mha.onnx --spec models/mha.toml --golden --from build
    """
    from attn_export.model_spec.shapes import parse_shapes
    from attn_export.pipelines.localize import LocalizeOptions, localize_model
    from attn_export.report.localize_text import format_localize
    from attn_export.report.model_explorer import format_overlay
    from attn_export.report.output_plan import OutputPlan, folder_graphs

    points = parse_shapes(shapes) if shapes else None
    if points is not None and len(points) != 1:
        raise click.UsageError("--shapes: localize takes one case; give one shape point")
    options = LocalizeOptions(
        models_dir=models_dir,
        sizes=points[0] if points else None,
        seed=seed,
        distribution=distribution,
        mask_case=mask_case,
        provider=provider,
        runtime=runtime,
        max_memory=max_memory,
        lock_wait_s=wait_s,
        shrink=shrink,
        bundle=bundle,
        decode_step=decode_step,
        generate_step=generate_step,
        generate_steps=generate_steps or 0,
        layout=layout,
        decode_steps=decode_steps,
        fully_masked=fully_masked,
        golden=golden,
        golden_checkout=golden and given("models_dir"),
        golden_from=golden_from,
        spec_file=spec_path,
        variant=variant,
        timeout_s=timeout_s,
    )
    with flag_names(sizes="--shapes", spec_file="--spec", golden_from="--from"):
        options.check()  # before any file is read
        if spec_path is None and folder.is_file():
            raise click.UsageError(f"{folder} is a file: give its build folder, or --spec for a graph no build made")
        graphs: Iterable[Path]
        if spec_path is not None:
            builds, graphs = [folder.parent], [folder]
            if golden_from is not None:  # the build whose recording the graph is paired with
                builds, graphs = [*builds, golden_from], itertools.chain(graphs, folder_graphs(golden_from))
        else:
            builds, graphs = [folder], folder_graphs(folder, None if model is None else [model])
        plan = OutputPlan.make(
            {"json": json_path, "overlay": overlay_path},
            reads=[bundle / "bundle.json", bundle / "reproduce.sh"] if bundle is not None else [],  # the same run's
            graphs=graphs,
            read_builds=builds,
            made=bundle,
        )
        report = localize_model(folder, model, options)
    plan.echo(format_localize(report))
    plan.write_texts({"json": lambda: json_text(report.to_dict()), "overlay": lambda: format_overlay(report)})
    sys.exit(0 if report.passed(strict_regions) else 1)
