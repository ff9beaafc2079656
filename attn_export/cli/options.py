"""The options and parameter types commands share, as decorators (sqlite-utils'
``output_options``), and the small helpers their commands call."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from attn_export.artifacts.files import LOCK_WAIT_S
from attn_export.errors import AttnExportError, OptionError, UsageError
from attn_export.model_spec import VARIANTS, variant_chain
from attn_export.report import BENCH_FORMATS, FORMATS
from attn_export.report.output_plan import STDOUT, JsonTarget
from attn_export.runtimes import PROVIDERS
from attn_export.runtimes.ort import MAX_TIMEOUT_S, RUN_TIMEOUT_S

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class FiniteFloat(click.FloatRange):
    """A FloatRange that refuses nan and inf: nan passes every range comparison, and would
    fail every case (--atol nan) or switch a gate off (--max-slowdown nan)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class PathArg(click.Path):
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


FILE = PathArg(dir_okay=False)


class _JsonFile(PathArg):
    """``--json``'s value: a file, or ``-`` for stdout (a file named ``-`` is ``./-``).

    ``bare`` is for the commands whose ``--json`` may come without a value (list, build and
    inspect took it as a flag): the next word becomes the value, so ``list --json mha`` would
    write the specs over a file named mha. There the file must end in .json, and any other
    word is refused."""

    def __init__(self, bare: bool) -> None:
        super().__init__(dir_okay=False)
        self.bare = bare

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == STDOUT:
            return STDOUT
        if self.bare and isinstance(value, str) and not value.lower().endswith(".json"):
            self.fail(
                f"{value!r} is not a .json file. --json takes the word after it as its file: to print JSON, "
                "put --json last or write --json -; to write a file, name one ending in .json.",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


def json_option(help: str, bare: bool = False) -> Decorator:  # noqa: A002
    """``--json FILE`` (``-``: stdout), one meaning for every command; with ``bare`` a
    plain ``--json`` means ``-``."""
    flag: dict[str, Any] = {"is_flag": False, "flag_value": STDOUT} if bare else {}
    metavar = "[FILE]" if bare else "FILE"
    return click.option("--json", "json_path", type=_JsonFile(bare), metavar=metavar, help=help, **flag)


#: --max-slowdown's values; the GitHub Action checks its input with it before building.
MAX_SLOWDOWN = FiniteFloat(0, min_open=True)


def notice(line: str) -> None:
    click.echo(f"note: {line}", err=True)


def _folder_option(flag: str, dest: str, default: str, help: str) -> Decorator:  # noqa: A002
    folder = PathArg(file_okay=False)
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


def timeout_option(flag: str, help: str) -> Decorator:  # noqa: A002
    """A run's time limit in seconds (``runtimes.ort.run_bounded``), shared by replay,
    localize (``--timeout``) and verify (``--region-timeout``)."""
    return click.option(
        flag,
        "timeout_s",
        type=FiniteFloat(0, MAX_TIMEOUT_S, min_open=True),
        default=RUN_TIMEOUT_S,
        show_default=True,
        metavar="SECONDS",
        help=help,
    )


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
                type=_JsonFile(bare=False) if fmt.name == "json" else FILE,
                help=fmt.help,
            )(command)
        return command

    return decorate


def format_targets(
    formats: dict[str, Any], prefix: str, given: dict[str, JsonTarget | None]
) -> dict[str, JsonTarget | None]:
    """From a command's keywords: format name -> what its option was given (``OutputPlan.make``'s ``given``)."""
    return {name: given[_format_dest(prefix, name)] for name in formats}


report_options = _format_options(FORMATS, "report_")
bench_report_options = _format_options(BENCH_FORMATS, "bench_")


wait_option = click.option(
    "--wait",
    "wait_s",
    type=FiniteFloat(0),
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
    from attn_export.model_spec.memory import parse_bytes

    try:
        return parse_bytes(value, "--max-memory")
    except AttnExportError as e:
        raise click.BadParameter(str(e).removeprefix("--max-memory: ")) from e


def _models_option(help: str) -> Decorator:  # noqa: A002 - mirrors click's keyword
    return _folder_option("--models", "models_dir", "models", help)


#: verify's and localize's --models: where the PyTorch originals come from.
checkout_models_option = _models_option(
    "The checkout's spec folder: PyTorch originals are rebuilt from these specs, never from the manifest. "
    "Given with --golden (verify, localize): each graph's recorded spec must be the one here."
)


@contextmanager
def flag_names(**renamed: str) -> Iterator[None]:
    """The library's OptionError said with the running command's flags: the options' one
    mapping from parameter to flag. A parameter is set by the option of its name
    (``n_random`` by ``--random``), else by the flag ``renamed`` gives (``spec_file="--spec"``)."""
    try:
        yield
    except OptionError as e:
        params = click.get_current_context().command.params
        flags = {p.name: p.opts[0] for p in params if isinstance(p, click.Option) and p.name}
        raise UsageError(e.named(flags | renamed)) from e


def given(param: str) -> bool:
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
        "this spec's module, as a built graph is; replaces --models. verify: not with --golden; localize: "
        "with --golden, also --from BUILD (the build whose recording it is judged by).",
    )(f)


models_option = _models_option("Folder of *.toml model specs.")


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
