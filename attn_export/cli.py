"""The command line: a thin layer over the library. Commands parse, call one library
function, and render.

Every command turns the library's errors into one line on stderr and an exit code
(0 success, 1 a check failed, 2 bad usage or input); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from attn_export import __version__
from attn_export.artifacts.files import LOCK_WAIT_S
from attn_export.artifacts.targets import TARGETS as BUILD_TARGETS
from attn_export.errors import AttnExportError, first_line
from attn_export.report import BENCH_FORMATS, FORMATS
from attn_export.runtimes import PROVIDERS, RUNTIMES
from attn_export.runtimes.target import DEFAULT_RUNTIME
from attn_export.spec import EXPORTERS, VARIANTS, variant_chain
from attn_export.spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.spec.distributions import DISTRIBUTIONS
from attn_export.spec.masks import CASES
from attn_export.spec.model import FULLY_MASKED
from attn_export.spec.scenarios import SCENARIOS

if TYPE_CHECKING:
    from attn_export.artifacts.manifest import Manifest
    from attn_export.pipelines.bench.results import RunnerOptions
    from attn_export.report.bench_text import Widths

__all__ = ["cli", "main"]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


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


class _FiniteFloat(click.FloatRange):
    """A FloatRange that refuses nan and inf: nan passes every range comparison, and would
    fail every case (--atol nan) or switch a gate off (--max-slowdown nan)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class _Path(click.Path):
    """A path to read or write: click turns an empty value (an unset ``$VAR``) into ``.``,
    the working directory, which a build then wrote into and a report option called a
    directory the user never named."""

    def __init__(self, file_okay: bool = True, dir_okay: bool = True) -> None:
        super().__init__(path_type=Path, file_okay=file_okay, dir_okay=dir_okay)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            kind = "a folder" if not self.file_okay else "a file" if not self.dir_okay else "a file or folder"
            self.fail(f"an empty path; name {kind}.", param, ctx)
        return super().convert(value, param, ctx)


FILE = _Path(dir_okay=False)

#: --max-slowdown's values; the GitHub Action checks its input with it before building.
MAX_SLOWDOWN = _FiniteFloat(0, min_open=True)


def _notice(line: str) -> None:
    click.echo(f"note: {line}", err=True)


def _unbuilt_notice(models_dir: Path, manifest: Manifest, out_dir: Path) -> None:
    """Say which checkout specs the build folder has no graph of: a verify of the whole
    folder passes over the models it holds, and a spec left unbuilt is not among them."""
    built = {entry.model_spec.name for entry in manifest.models.values()}
    unbuilt = sorted(p.stem for p in models_dir.glob("*.toml") if p.stem not in built) if models_dir.is_dir() else []
    if unbuilt:
        listed = ", ".join(unbuilt[:5]) + (", ..." if len(unbuilt) > 5 else "")
        some = f"{len(unbuilt)} specs in {models_dir} have" if len(unbuilt) > 1 else f"a spec in {models_dir} has"
        _notice(f"{some} no graph in {out_dir}, so not verified: {listed}")


def _folder_option(flag: str, dest: str, default: str, help: str) -> Decorator:  # noqa: A002
    folder = _Path(file_okay=False)
    return click.option(flag, dest, type=folder, default=Path(default), show_default=True, help=help)


def out_option(help: str) -> Decorator:  # noqa: A002 - mirrors click's keyword
    """--out, shared by build and bench (both write into a build folder)."""
    return _folder_option("--out", "out_dir", "build", help)


class _VariantChoice(click.Choice):
    """A variant of the table, or a chain of them (``ort-past+int8``): checked by the
    library (``variant_chain``), whose error is one line naming the link that cannot be."""

    def __init__(self) -> None:
        super().__init__(list(VARIANTS))

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        variant_chain(value)
        return value


def variant_option(help: str) -> Decorator:  # noqa: A002
    """--variant (repeatable), shared by build and bench: a variant or a chain ``a+b``."""
    chains = " A chain such as ort-past+int8 makes each link from the graph of the one before."
    return click.option("--variant", "variants", multiple=True, type=_VariantChoice(), help=help + chains)


def provider_option(help: str) -> Decorator:  # noqa: A002
    """A single --provider for ONNX Runtime, shared by build, bench and inspect."""
    return click.option("--provider", type=click.Choice(list(PROVIDERS)), default="cpu", show_default=True, help=help)


def threads_option(help: str) -> Decorator:  # noqa: A002
    return click.option("--threads", type=click.IntRange(1), help=f"{help} Default: physical cores.")


def _format_dest(prefix: str, name: str) -> str:
    """The keyword a format's ``--<name>`` option fills: ``<prefix><name>``, a Python name."""
    return prefix + name.replace("-", "_")


def _format_options(formats: dict[str, Any], prefix: str) -> Decorator:
    """One ``--<format> FILE`` option per format of a registry (``_format_dest`` names its keyword)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for fmt in reversed(list(formats.values())):
            command = click.option(
                f"--{fmt.name}",
                _format_dest(prefix, fmt.name),
                type=FILE,
                help=fmt.help,
            )(command)
        return command

    return decorate


def _format_paths(formats: dict[str, Any], prefix: str, given: dict[str, Path | None]) -> dict[str, Path | None]:
    """Format name -> the path its option was given (None where not), from a command's keywords."""
    return {name: given[_format_dest(prefix, name)] for name in formats}


report_options = _format_options(FORMATS, "report_")
bench_report_options = _format_options(BENCH_FORMATS, "bench_")


wait_option = click.option(
    "--wait",
    "wait_s",
    type=_FiniteFloat(0),
    default=LOCK_WAIT_S,
    show_default=True,
    help="Seconds to wait for a build of the same folder in progress to finish before giving up.",
)
max_memory_option = click.option(
    "--max-memory",
    callback=lambda ctx, param, value: None if value is None else _bytes(value),
    help="Memory budget per case, e.g. 8GiB; a case that cannot fit is refused before anything is allocated. "
    "Default: $ATTN_EXPORT_MAX_MEMORY, else the checkout spec's max_memory (never a manifest's), "
    "else half this machine's memory.",
)


def _bytes(value: str) -> int:
    from attn_export.spec.memory import parse_bytes

    try:
        return parse_bytes(value)
    except AttnExportError as e:
        raise click.BadParameter(str(e).removeprefix("--max-memory: ")) from e


def _models_option(help: str) -> Decorator:  # noqa: A002 - mirrors click's keyword
    return _folder_option("--models", "models_dir", "models", help)


#: verify's and localize's --models: where the PyTorch originals come from.
checkout_models_option = _models_option(
    "The checkout's spec folder: PyTorch originals are rebuilt from these specs, never from the manifest. "
    "Given with verify --golden: each graph's recorded spec must be the one here."
)


def _given(param: str) -> bool:
    """Whether the user named ``param`` (not its default)."""
    return click.get_current_context().get_parameter_source(param) is not click.core.ParameterSource.DEFAULT


def outside_graph_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--spec`` and ``--variant``: one .onnx file no build made, judged against a spec."""
    f = click.option(
        "--variant",
        default="fp32",
        show_default=True,
        help="With --spec: the variant the graph is (its name and tolerance), e.g. int8.",
    )(f)
    return click.option(
        "--spec",
        "spec_path",
        type=FILE,
        help="Take one .onnx file no build made (edited by hand, or exported by a script) and judge it against "
        "this spec's module, as a built graph is; replaces --models. Not with --golden.",
    )(f)


def _check_outside(spec_path: Path | None, variant: str) -> None:
    if spec_path is None and variant != "fp32":
        raise click.UsageError("--variant needs --spec: a built graph's manifest names its own variant")


models_option = _models_option("Folder of *.toml model specs.")


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
        click.echo(json.dumps([s.to_dict() for s in specs], indent=2))
    else:
        click.echo(format_spec_table(specs))


def _jobs(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """--jobs N or auto (the CPUs this process may use)."""
    if value is None:
        return None
    if value == "auto":
        from attn_export.runtimes.timing import usable_cpus

        return usable_cpus()
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise click.BadParameter(f"{value!r} is not a number of jobs (1 or more) or auto")
    return int(value)


def executor_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--jobs and --executor: where a pipeline's cells run (``attn_export.executors``)."""
    from attn_export.executors import EXECUTORS

    command = click.option(
        "--executor",
        type=click.Choice(list(EXECUTORS)),
        default="local",
        show_default=True,
        help="Where cells run: " + "; ".join(f"{k.name}: {k.help}" for k in EXECUTORS.values()) + ".",
    )(command)
    return click.option(
        "--jobs",
        callback=_jobs,
        help="Cells run at once: N or auto (this machine's CPUs). Default: 1 locally, the cluster's CPUs on ray. "
        "Timing never runs beside another cell.",
    )(command)


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
@provider_option("Provider that ort-optimized optimizes for and auto times on.")
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
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of progress lines.")
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
    as_json: bool,
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
    from attn_export.pipelines.build import BuildOptions, build_models
    from attn_export.report.build_text import format_build_line, format_build_summary
    from attn_export.spec import spec_paths

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
    )
    on_result = None if as_json else (lambda r: click.echo(format_build_line(r)))
    parallelism = Parallelism(executor, jobs)
    summary = build_models(spec_paths(models_dir, names), options, on_result, _notice, parallelism)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
        for r in summary.results:
            if r.error:
                click.echo(f"Error: {r.error}", err=True)
    else:
        click.echo(format_build_summary(summary))
    sys.exit(summary.exit_code)


@cli.command("inspect")
@click.argument("file", type=_Path())
@provider_option("Check that every op has a kernel on this ONNX Runtime provider.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect_cmd(file: Path, provider: str, as_json: bool) -> None:
    """Describe any ONNX file: IR version, opsets, producer, metadata, inputs and outputs
    with symbolic dims, op histogram, parameters, external data, and whether every op has
    a kernel on the provider (exit 1 if not).

    External data pointing outside the file's folder is refused, never read.

    Example:

    \b
        attn-export inspect build/mha.onnx --json
    """
    from attn_export.pipelines.inspect import inspect_file
    from attn_export.report.inspect_text import format_inspect

    result = inspect_file(file, provider)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_inspect(result))
    sys.exit(0 if result.kernels_ok else 1)


@cli.command("check")
@click.argument("paths", nargs=-1, required=True, type=_Path())
@click.option(
    "--min-opset", type=click.IntRange(1), default=7, show_default=True, help="Lowest default-domain opset allowed."
)
@click.option(
    "--max-opset",
    type=click.IntRange(1),
    help="Highest default-domain opset allowed. Default: the newest onnx defines.",
)
@click.option(
    "--allow-domain",
    "domains",
    multiple=True,
    help="Operator domain allowed besides ai.onnx, ai.onnx.ml and com.microsoft (repeatable).",
)
@click.option("--json", "json_path", type=FILE, help="Write the report as JSON.")
def check_cmd(
    paths: tuple[Path, ...], min_opset: int, max_opset: int | None, domains: tuple[str, ...], json_path: Path | None
) -> None:
    """The static checks, for a pre-commit hook: nothing runs, nothing imports torch.

    PATHS are .onnx files, golden files, manifest.json files or build folders. Each graph
    is held to onnx.checker (full check), no random op, its opset and operator domains on
    the allow-list, and named dims; a graph its folder's manifest names also to the
    manifest's sha256 of it and its golden file, and to the spec's dynamic axes (symbolic,
    distinct, named as the spec names them). Exit 0 when every file passes, 1 when one
    does not, 2 on bad usage.

    Example:

    \b
        attn-export check build
        attn-export check build/mha.onnx exported/model.onnx --max-opset 21
    """
    from attn_export.artifacts.files import write_output
    from attn_export.exporter.graph_checks import DEFAULT_DOMAINS
    from attn_export.pipelines.check import CheckOptions, check_paths
    from attn_export.report import build_files, check_report_paths, folder_graphs, graph_data
    from attn_export.report.check_text import format_check

    graphs = [g for p in paths for g in (folder_graphs(p) if p.is_dir() else [p])]
    reads = [*paths, *graph_data(g for g in graphs if g.suffix == ".onnx" and g.is_file())]
    reads += [f for folder in {p if p.is_dir() else p.parent for p in paths} for f in build_files(folder)]
    check_report_paths({"json": json_path}, reads=reads, summary=False)
    options = CheckOptions(min_opset, max_opset, tuple(dict.fromkeys((*DEFAULT_DOMAINS, *domains))))
    report = check_paths(paths, options)
    click.echo(format_check(report))
    if json_path is not None:
        write_output(json_path, (json.dumps(report.to_dict(), indent=2) + "\n").encode())
    sys.exit(report.exit_code)


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    from attn_export.pipelines.verify.models import parse_shard

    try:
        return None if value is None else parse_shard(value)
    except AttnExportError as e:
        raise click.BadParameter(str(e)) from e


@cli.command()
@click.argument("paths", nargs=-1, type=_Path())
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
    type=_FiniteFloat(0),
    help="Override every output's absolute tolerance (a lossy variant's share of the output's rms too).",
)
@click.option("--rtol", type=_FiniteFloat(0), help="Override every output's relative tolerance.")
@threads_option("Threads for both PyTorch and ONNX Runtime.")
@click.option("--no-latency", is_flag=True, help="Skip timing.")
@click.option(
    "--latency-budget",
    type=_FiniteFloat(0.001),
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
    **reports: Path | None,
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
    """
    from attn_export.artifacts.files import LOCK_NAME
    from attn_export.artifacts.folder import tidy
    from attn_export.artifacts.manifest import MANIFEST_NAME
    from attn_export.executors import Parallelism
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
    from attn_export.report import build_files, check_report_paths, check_reports_spare, graph_data, write_reports
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
    from attn_export.spec.shapes import parse_shapes

    if inputs_file and (shapes or distributions):
        raise click.UsageError("--inputs replaces the sweep: it cannot be combined with --shapes or --distribution")
    if golden and (shapes or distributions):
        raise click.UsageError(
            "--shapes and --distribution cannot be combined with --golden (golden files fix their cases)"
        )
    if mask_case and not shapes:
        raise click.UsageError("--mask-case needs --shapes (the sweep already holds every mask case)")
    if localize_first and golden:
        raise click.UsageError("--localize compares with PyTorch: it cannot be combined with --golden")
    _check_outside(spec_path, variant)
    report_paths = _format_paths(FORMATS, "report_", reports)
    check_report_paths(report_paths)  # before the folder is read; again below, with what it reads
    parallelism = Parallelism(executor, jobs)
    out_dir, manifest, names = select_models(list(paths) or [Path("build")], spec_path, variant)
    folder_files = [f for e in manifest.models.values() for f, _ in e.files()]
    check_reports_spare(report_paths, out_dir, [MANIFEST_NAME, LOCK_NAME, *folder_files])
    graphs = [out_dir / manifest.models[n].file for n in names]
    check_report_paths(report_paths, reads=[*build_files(out_dir), *graph_data(graphs)])  # the summary too
    whole = not golden and spec_path is None and all(p.is_dir() for p in paths)
    options = VerifyOptions(
        targets=resolve_targets(runtimes or (DEFAULT_RUNTIME,), providers or ("cpu",)),
        models_dir=models_dir,
        golden=golden,
        golden_checkout=golden and _given("models_dir"),
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
    )
    options.check()  # before the folder's decoders are picked for --scenario
    if scenario:
        names = decoder_names(manifest, names, scenario, _notice)
    selected, names = names, shard_names(names, shard)
    notice = tidy(out_dir) if spec_path is None else None  # a graph's own folder is no build's to tidy
    if notice:
        _notice(notice)
    if not names and not shard:
        click.echo("no model to verify")
        return
    printed: list[bool] = []
    w = VERIFY_WIDTHS.fitting([(n, manifest.models[n].model_spec) for n in names], [t.label for t in options.targets])

    def on_model(name: str, cases: list[CaseResult], check: ModelCheck) -> None:
        if not printed:  # the header only once a model has rows: an error stays one line
            printed.append(True)
            click.echo(header(w))
        click.echo(format_model_rows(name, cases, check, w))

    report = verify_artifacts(out_dir, manifest, names, options, on_model, _notice, parallelism)
    if shard:
        report.shard = Shard.of(selected, shard)
        if not names:  # its reports still say which shard it was, for report merge
            click.echo(f"shard {shard[0]}/{shard[1]} holds no model")
            write_reports(report, report_paths)
            return
    sections = (format_decode, format_generate, format_distributions, format_placement, format_failures)
    for text in (section(report) for section in sections):
        if text:
            click.echo(text)
    if localize_first:
        from attn_export.pipelines.localize import localize_failures
        from attn_export.report.localize_text import format_localize

        for found in localize_failures(report, options, _notice):
            click.echo(format_localize(found))
    click.echo(format_summary(report))
    if whole:
        _unbuilt_notice(models_dir, manifest, out_dir)
    write_reports(report, report_paths)
    sys.exit(report.exit_code)


@cli.group("report")
def report_group() -> None:
    """Work with the reports verify writes."""


@report_group.command("merge")
@click.argument("files", nargs=-1, required=True, type=FILE)
@report_options
def report_merge(files: tuple[Path, ...], **reports: Path | None) -> None:
    """Put the JSON reports of a sharded verify (each shard's --shard i/n --json FILE)
    together: the reports one unsharded run would give, the same JSON apart from timings.

    Shards of different builds, seeds, options or versions, a shard missing or given twice,
    are refused in one line (exit 2). Exit 0 when the merged run passed, 1 when it failed.

    Example:

    \b
        attn-export report merge shard-*.json --junit junit.xml --markdown verify.md --json verify.json
    """
    from attn_export.pipelines.verify.merge import merge_shards
    from attn_export.report import check_report_paths, write_reports
    from attn_export.report.json_report import read_json_report
    from attn_export.report.verify_text import format_failures, format_summary

    report_paths = {name.removeprefix("report_"): path for name, path in reports.items()}
    check_report_paths(report_paths, reads=files)
    report = merge_shards([(str(f), read_json_report(f)) for f in files])
    for text in (format_failures(report), format_summary(report)):
        if text:
            click.echo(text)
    write_reports(report, report_paths)
    sys.exit(report.exit_code)


@cli.command()
@click.argument("folder", type=_Path())
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
    "--layout", help="With --decode-step: the trajectory's padding layout (batch-1, left-padded). Default: the first."
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
    type=_Path(file_okay=False),
    help="Write a replay bundle of the blamed region into this new folder (attn-export replay reruns it).",
)
@click.option("--json", "json_path", type=FILE, help="Write the report as JSON.")
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
@max_memory_option
@wait_option
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
    layout: str | None,
    decode_steps: int,
    fully_masked: str | None,
    runtime: str,
    provider: str,
    shrink: bool,
    bundle: Path | None,
    json_path: Path | None,
    overlay_path: Path | None,
    golden: bool,
    max_memory: int | None,
    wait_s: float,
) -> None:
    """Name the first node where a built graph leaves PyTorch on one case, with the FX
    node, module and source line it came from. FOLDER is a build folder, or with --spec
    one .onnx file no build made.

    Both sides run once with every intermediate value kept; then each group of ONNX nodes
    made from one FX node runs alone on PyTorch's values, so its own error is told apart
    from what it inherits. The case is verify's (its reproduce line gives --shapes, --seed,
    --distribution, --mask-case). Exit 0 when the case agrees, 1 when the graph diverges,
    2 on bad usage or input.

    Example:

    \b
        attn-export localize build mha --shapes "batch=2,seq=5,kv_seq=7" --seed 3
        attn-export localize build llama_attention --json where.json
        attn-export localize build mha --shapes "batch=8,seq=100" --shrink --bundle where/
        attn-export localize build mha_kv_cache --decode-step 3 --layout left-padded
        attn-export localize build mha --golden
        attn-export localize build mha --runtime onnx-reference
        attn-export localize edited/mha.onnx --spec models/mha.toml --shapes "batch=2,seq=5,kv_seq=7"
    """
    from attn_export.artifacts.files import write_output
    from attn_export.pipelines.localize import LocalizeOptions, localize_model
    from attn_export.report import build_files, check_report_paths, folder_graphs, graph_data
    from attn_export.report.localize_text import format_localize
    from attn_export.report.model_explorer import format_overlay
    from attn_export.spec.shapes import parse_shapes

    _check_outside(spec_path, variant)
    if spec_path is None and folder.is_file():
        raise click.UsageError(f"{folder} is a file: give its build folder, or --spec for a graph no build made")
    if spec_path is not None:
        reads = [*build_files(folder.parent), *graph_data([folder])]
    else:
        reads = [*build_files(folder), *graph_data(folder_graphs(folder, None if model is None else [model]))]
    if bundle is not None:  # written in the same run
        reads += [bundle / "bundle.json", bundle / "reproduce.sh"]
    check_report_paths({"json": json_path, "overlay": overlay_path}, bundle, reads=reads, summary=False)
    points = parse_shapes(shapes) if shapes else None
    if points is not None and len(points) != 1:
        raise click.UsageError("--shapes: localize takes one case; give one shape point")
    if layout and decode_step is None:
        raise click.UsageError("--layout needs --decode-step")
    if decode_step is None and _given("decode_steps"):
        raise click.UsageError("--decode-steps needs --decode-step")
    if decode_step is not None and _given("distribution"):
        raise click.UsageError("--distribution has no meaning with --decode-step: the steps feed unit-normal tokens")
    if shrink and decode_step is not None:
        raise click.UsageError("--shrink searches over sizes: a decode step's sizes are its trajectory's")
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
        layout=layout,
        decode_steps=decode_steps,
        fully_masked=fully_masked,
        golden=golden,
        spec_file=spec_path,
        variant=variant,
    )
    report = localize_model(folder, model, options)
    click.echo(format_localize(report))
    if json_path is not None:
        write_output(json_path, (json.dumps(report.to_dict(), indent=2) + "\n").encode())
    if overlay_path is not None:
        write_output(overlay_path, format_overlay(report).encode())
    sys.exit(0 if report.agrees else 1)


@cli.command()
@click.argument("folder", type=_Path(file_okay=False))
@provider_option("ONNX Runtime provider to rerun the region on.")
@max_memory_option
def replay(folder: Path, provider: str, max_memory: int | None) -> None:
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

    result = replay_bundle(folder, provider, max_memory)
    click.echo(format_replay(result))
    sys.exit(0 if result.passed else 1)


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
    type=_FiniteFloat(0.01),
    default=0.2,
    show_default=True,
    help="Seconds of timed repeats per runner and shape.",
)
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory probes (one process per runner).")
@max_memory_option
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
    torch_compile: bool,
    decode: bool,
    pasts: list[int] | None,
    scenario: str | None,
    runtimes: tuple[str, ...],
    executor: str,
    jobs: int | None,
    **reports: Path | None,
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
    from attn_export.pipelines.bench.results import BenchOptions, RunnerOptions
    from attn_export.pipelines.bench.run import bench_models
    from attn_export.report import bench_text, check_bench_formats
    from attn_export.spec import spec_paths

    files = _format_paths(BENCH_FORMATS, "bench_", reports)
    check_bench_formats(files, out_dir)
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
        "torch_compile": torch_compile,
        # the default set's rewrites, asked for by no one, may fail on a model without failing the run
        "variants": tuple(dict.fromkeys(variants)) or RunnerOptions.variants,
        "optional": () if variants else RunnerOptions.variants[1:],
    }
    flags = {"--batch": "batches", "--seq": "seqs", "--past": "pasts"}
    typed = [f for f, name in flags.items() if _given(name)]
    if scenario and typed:
        raise click.UsageError(f"--scenario sets the batch, past and query tokens: drop {', '.join(typed)}")
    if decode or scenario:
        if "--seq" in typed:
            raise click.UsageError("--seq has no meaning with --decode: a decode step is one token (choose --past)")
        from attn_export.pipelines.bench.decode import bench_decode_models
        from attn_export.pipelines.bench.results import DecodeBenchOptions

        decode_options = DecodeBenchOptions(pasts=pasts, scenario=scenario, **shared)
        paths = spec_paths(models_dir, names)
        w = _widths(bench_text.DECODE_WIDTHS, paths, decode_options)
        _run_bench(
            lambda on_row: bench_decode_models(
                paths, out_dir, decode_options, on_row, skip_without_cache=not names, parallelism=parallelism
            ),
            (bench_text.decode_header(w), partial(bench_text.format_decode_row, w=w), bench_text.format_decode_summary),
            files,
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
        files,
    )


def _widths(default: Widths, paths: list[Path], options: RunnerOptions) -> Widths:
    """The table's column widths, fitting every model and runner the run can print."""
    from attn_export.pipelines.bench.runners import COMPILED, EAGER, SDPA

    graphs = [RUNTIMES[n].runner_label(v) for n in options.runtimes for v in options.variants]
    return default.fitting([p.stem for p in paths], [EAGER, SDPA, COMPILED, *graphs])


def _run_bench(
    run: Callable[[Callable[[Any], None]], tuple[Any, Any]],
    text: tuple[str, Callable[[Any], str], Callable[[Any], str]],
    files: dict[str, Path | None],
) -> None:
    """Build what is missing and time (``run``), print rows as they come and the summary
    (``text``: header, row, summary), write the report files asked for (``BENCH_FORMATS``)."""
    from attn_export.report import write_bench_reports
    from attn_export.report.build_text import format_build_line

    header, format_row, format_summary = text
    printed: list[bool] = []

    def on_row(row: Any) -> None:
        if not printed:
            printed.append(True)
            click.echo(header)
        click.echo(format_row(row))

    built, report = run(on_row)
    if report is None:
        for r in built.results:
            if not r.ok:
                click.echo(format_build_line(r), err=True)
        sys.exit(built.exit_code)
    click.echo(format_summary(report))
    write_bench_reports(report, files)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="attn-export")
