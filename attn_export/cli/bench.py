"""attn-export bench: PyTorch and ONNX Runtime timed side by side."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from attn_export.cli.group import cli
from attn_export.cli.options import (
    FiniteFloat,
    JsonTarget,
    bench_report_options,
    executor_options,
    flag_names,
    format_targets,
    given,
    max_memory_option,
    models_option,
    out_option,
    provider_option,
    threads_option,
    timeout_option,
    variant_option,
)
from attn_export.model_spec.scenarios import SCENARIOS
from attn_export.report import BENCH_FORMATS
from attn_export.runtimes import RUNTIMES
from attn_export.runtimes.target import DEFAULT_RUNTIME

if TYPE_CHECKING:
    from attn_export.pipelines.bench.results import RunnerOptions
    from attn_export.report.bench_text import Widths
    from attn_export.report.output_plan import OutputPlan


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """'1,8' or a doubling run written '64,128,...,2048'."""
    return _sizes(value, minimum=1)


def _past_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """--past: like --seq, but 0 (an empty cache) is a length too."""
    return None if value is None else _sizes(value, minimum=0)


def _sizes(value: str, minimum: int) -> list[int]:
    """The sizes of a list, each once, in the order given ('16,16' would time each row twice)."""
    parts = [p.strip() for p in value.split(",")]
    try:
        if not all(p == "..." or (p.isascii() and p.isdigit()) for p in parts):
            raise ValueError  # '16,,32' too
        if len(parts) == 4 and parts[2] == "...":
            start, step, stop = int(parts[0]), int(parts[1]), int(parts[3])
            if not 0 < start < step <= stop:
                raise ValueError
            out = [start]
            while out[-1] * step // start <= stop and len(out) < 64:
                out.append(out[-1] * step // start)
            return out
        values = [int(p) for p in parts]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of sizes like 1,8 or 64,128,...,2048") from None
    if not values or min(values) < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise click.BadParameter(f"{value!r}: sizes must be {kind} integers")
    return list(dict.fromkeys(values))


@cli.command()
@click.argument("names", nargs=-1)
@models_option
@out_option("Build folder; missing variants are built into it first.")
@click.option("--batch", "batches", default="1", show_default=True, callback=_int_list, help="Batch sizes, e.g. 1,8.")
@click.option(
    "--seq",
    "seqs",
    default="64,128,...,512",
    show_default=True,
    callback=_int_list,
    help="Sequence lengths (every non-batch dim; a decoder's past at its least, as for a prompt), "
    "e.g. 128,512 or 64,128,...,2048.",
)
@variant_option(
    "ONNX Runtime graph variants to time (repeatable). Default: fp32, ort-fused, int8; a default ort-fused or "
    "int8 that cannot be made for a model is left out of its rows, with why, while one named here fails the run."
)
@provider_option("ONNX Runtime provider to time on (PyTorch runs on the matching device).")
@click.option(
    "--runtime",
    "runtimes",
    multiple=True,
    type=click.Choice(list(RUNTIMES)),
    default=[DEFAULT_RUNTIME],
    show_default=True,
    help="Runtime that runs each variant's graph (repeatable); its rows read e.g. ort:fp32.",
)
@threads_option("Threads for every runner.")
@click.option(
    "--budget",
    type=FiniteFloat(0.01),
    default=0.2,
    show_default=True,
    help="Seconds of timed repeats per runner and shape.",
)
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory probes (one process per runner).")
@max_memory_option
@timeout_option(
    "--region-timeout",
    "Stop the first, untimed run of a graph holding a Loop on ONNX Runtime after this many seconds (its timed "
    "runs are not stopped: a timer would be timed with them): a Loop without end fails the run in one line.",
)
@click.option(
    "--compile",
    "torch_compile",
    is_flag=True,
    help="Also time torch.compile(module, dynamic=True) (Inductor; on CPU it needs a C++ compiler), its rows "
    "read torch-compile; the seconds spent compiling each shape are reported apart from its latency.",
)
@click.option(
    "--decode",
    is_flag=True,
    help="Time one decode step (seq 1) of models with a key/value cache against the past length, "
    "ONNX Runtime with inputs and outputs bound; without NAMES, the zoo's models with a cache.",
)
@click.option(
    "--past",
    "pasts",
    callback=_past_list,
    help="With --decode: past lengths, e.g. 0,128,512. Default: 0,128,512,2048 clamped to the spec's range.",
)
@click.option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    help="Time a decoder scenario preset's steps as bench --decode times its steps (its batch, past, query "
    "tokens per step and steps replace --batch, --past and --seq); without NAMES, the zoo's models with a cache.",
)
@executor_options
@bench_report_options
def bench(
    names: tuple[str, ...],
    models_dir: Path,
    out_dir: Path,
    batches: list[int],
    seqs: list[int],
    variants: tuple[str, ...],
    provider: str,
    threads: int | None,
    budget: float,
    no_memory: bool,
    max_memory: int | None,
    timeout_s: float,
    torch_compile: bool,
    decode: bool,
    pasts: list[int] | None,
    scenario: str | None,
    runtimes: tuple[str, ...],
    executor: str,
    jobs: int | None,
    **reports: JsonTarget | None,
) -> None:
    """Time PyTorch eager, PyTorch SDPA and ONNX Runtime (each variant) side by side, for
    the zoo or NAMES (models in --models, or spec files); with --compile, torch.compile too.

    Reports p50/p90 latency, tokens per second, the ratio to PyTorch eager, achieved
    GFLOP/s and its share of this machine's float32 GEMM peak (measured in the same run),
    and each runner's peak memory. Figures belong here, never in tests.

    With --decode: per-token latency of one decode step (seq 1) against the cache's past
    length, PyTorch eager with its cache and ONNX Runtime (each variant) feeding their
    presents back, tokens per second, the ratio to eager and peak memory.

    Example:

    \b
        attn-export bench mha --batch 1,8 --seq 64,128,...,2048 --plot latency.png
        attn-export bench path/to/model.toml --seq 128,512
        attn-export bench mha --seq 128,512,2048 --compile
        attn-export bench mha_kv_cache --decode --past 0,128,256 --plot decode.png
        attn-export bench mha_kv_cache --scenario speculative
        attn-export bench --executor ray   # one model x shape per node of $RAY_ADDRESS's cluster
    """
    from attn_export.executors import Parallelism
    from attn_export.model_spec import spec_paths
    from attn_export.pipelines.bench.results import BenchOptions, RunnerOptions
    from attn_export.pipelines.bench.run import bench_models
    from attn_export.report import bench_text
    from attn_export.report.output_plan import OutputPlan, folder_graphs

    plan = OutputPlan.make(
        format_targets(BENCH_FORMATS, "bench_", reports),
        graphs=folder_graphs(out_dir),
        read_builds=[out_dir],
        made=out_dir,
        formats=BENCH_FORMATS,
    )
    with flag_names():
        parallelism = Parallelism(executor, jobs)
        # What bench and bench --decode take alike.
        shared: dict[str, Any] = {
            "batches": batches,
            "provider": provider,
            "threads": threads,
            "budget_s": budget,
            "memory": not no_memory,
            "runtimes": tuple(dict.fromkeys(runtimes)),
            "max_memory": max_memory,
            "region_timeout_s": timeout_s,
            "torch_compile": torch_compile,
            # the default set's rewrites, asked for by no one, may fail on a model without failing the run
            "variants": tuple(dict.fromkeys(variants)) or RunnerOptions.variants,
            "optional": () if variants else RunnerOptions.variants[1:],
        }
        flags = {"--batch": "batches", "--seq": "seqs", "--past": "pasts"}
        typed = [f for f, name in flags.items() if given(name)]
        if scenario and typed:
            raise click.UsageError(f"--scenario sets the batch, past and query tokens: drop {', '.join(typed)}")
        if decode or scenario:
            if "--seq" in typed:
                raise click.UsageError("--seq has no meaning with --decode: a decode step is one token (choose --past)")
            from attn_export.pipelines.bench.decode_timing import bench_decode_models
            from attn_export.pipelines.bench.results import DecodeBenchOptions

            decode_options = DecodeBenchOptions(pasts=pasts, scenario=scenario, **shared)
            paths = spec_paths(models_dir, names)
            w = _widths(bench_text.DECODE_WIDTHS, paths, decode_options)
            _run_bench(
                lambda on_row: bench_decode_models(
                    paths, out_dir, decode_options, on_row, skip_without_cache=not names, parallelism=parallelism
                ),
                (
                    bench_text.decode_header(w),
                    partial(bench_text.format_decode_row, w=w),
                    bench_text.format_decode_summary,
                ),
                plan,
            )
            return
        if pasts is not None:
            raise click.UsageError("--past needs --decode")
        options = BenchOptions(seqs=seqs, **shared)
        paths = spec_paths(models_dir, names)
        w = _widths(bench_text.BENCH_WIDTHS, paths, options)
        _run_bench(
            lambda on_row: bench_models(paths, out_dir, options, on_row, parallelism),
            (bench_text.bench_header(w), partial(bench_text.format_bench_row, w=w), bench_text.format_bench_summary),
            plan,
        )


def _widths(default: Widths, paths: list[Path], options: RunnerOptions) -> Widths:
    """The table's column widths, fitting every model and runner the run can print."""
    from attn_export.pipelines.bench.runners import COMPILED, EAGER, SDPA

    graphs = [RUNTIMES[n].runner_label(v) for n in options.runtimes for v in options.variants]
    return default.fitting([p.stem for p in paths], [EAGER, SDPA, COMPILED, *graphs])


def _run_bench(
    run: Callable[[Callable[[Any], None]], tuple[Any, Any]],
    text: tuple[str, Callable[[Any], str], Callable[[Any], str]],
    plan: OutputPlan,
) -> None:
    """Build what is missing and time (``run``), print rows as they come and the summary
    (``text``: header, row, summary), write the report files asked for (``BENCH_FORMATS``)
    and, for ``--json -``, the JSON on stdout instead of the text."""
    from attn_export.report.build_text import format_build_line
    from attn_export.report.json_report import dump_bench_json

    header, format_row, format_summary = text
    printed: list[bool] = []

    def on_row(row: Any) -> None:
        if not printed:
            printed.append(True)
            plan.echo(header)
        plan.echo(format_row(row))

    built, report = run(on_row)
    if report is None:
        for r in built.results:
            if not r.ok:
                click.echo(format_build_line(r), err=True)
        sys.exit(built.exit_code)
    plan.echo(format_summary(report))
    plan.write(lambda name, path: BENCH_FORMATS[name].write(report, path), json=lambda: dump_bench_json(report))
