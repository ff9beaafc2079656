"""The GitHub Action (``action.yml`` at the repository root) as code. Its composite steps set
up Python, install attn-export when it is missing, and run ``python -m
attn_export.github_action``, which does the rest: build (unless ``golden``), verify, write
the reports, the step's outputs (``$GITHUB_OUTPUT``) and its summary
(``$GITHUB_STEP_SUMMARY``), and exit non-zero when verify did not pass.

The inputs arrive as ``ATTN_EXPORT_<INPUT>`` variables (``build-dir`` is
``ATTN_EXPORT_BUILD_DIR``), which ``action.yml`` sets from ``${{ inputs.* }}``: values pass
through the environment, never through a shell's text.

``fail-on`` lists the gates that fail the step, each one a verify option:

* ``numerics``: always on; verify always judges the numbers.
* ``latency``: ``--max-slowdown`` with the ``max-slowdown`` input.
* ``placement``: ``--require-placement`` (nodes that fell back from the provider asked for).
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from attn_export.artifacts.files import append_output, resolved
from attn_export.errors import AttnExportError, OptionError, UsageError
from attn_export.report.output_plan import check_appended

__all__ = ["GATES", "ActionInputs", "build_command", "main", "report_paths", "run_action", "verify_command"]

#: What each ``fail-on`` gate adds to verify's command line (latency's ratio is an input).
GATES: dict[str, tuple[str, ...]] = {
    "numerics": (),
    "latency": ("--max-slowdown",),
    "placement": ("--require-placement",),
}
#: The input-to-variable convention: ``ATTN_EXPORT_`` and the input's name in capitals, ``-`` as ``_``.
PREFIX = "ATTN_EXPORT_"
#: The inputs' defaults, as ``action.yml`` declares them (a test holds the two equal).
DEFAULTS = {
    "models": "models",
    "build-dir": "build",
    "providers": "cpu",
    "shard": "",
    "golden": "false",
    "fail-on": "numerics",
    "max-slowdown": "2",
    "regions": "",
    "region-timeout": "",
    "reports-dir": "attn-export-reports",
}
#: What the step's ``outputs`` name each report (the keys are ``report.FORMATS``').
OUTPUTS = {"json": ".json", "junit": ".xml", "markdown": ".md"}
#: The inputs that name a folder: each becomes an argument of build or verify.
FOLDERS = ("models", "build-dir", "reports-dir")
#: The runner's files the step appends to.
RUNNER_FILES = ("GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY")


def _words(value: str) -> list[str]:
    """A list input: words separated by commas, spaces or new lines."""
    return [w for w in re.split(r"[\s,]+", value) if w]


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise UsageError(f"input {name}: {value!r} is neither true nor false")
    return lowered == "true"


@dataclass(frozen=True)
class ActionInputs:
    """The action's inputs, checked."""

    models: Path
    build_dir: Path
    providers: tuple[str, ...]
    shard: tuple[int, int] | None
    golden: bool
    fail_on: tuple[str, ...]
    max_slowdown: str
    #: verify's region check (``VerifyOptions.regions``): ``check``, ``strict``, or None.
    regions: str | None
    #: verify's ``--region-timeout`` (seconds), or None for its default.
    region_timeout: float | None
    reports_dir: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ActionInputs:
        """Read ``ATTN_EXPORT_*`` (an input left out or empty takes its default); UsageError
        naming the first input that is not valid."""
        import click

        from attn_export.cli import MAX_SLOWDOWN
        from attn_export.pipelines.verify import REGIONS
        from attn_export.pipelines.verify.models import parse_shard
        from attn_export.runtimes import PROVIDERS
        from attn_export.runtimes.ort import MAX_TIMEOUT_S, check_timeout

        raw = {name: env.get(PREFIX + name.upper().replace("-", "_"), "").strip() or d for name, d in DEFAULTS.items()}
        optionlike = next((name for name in FOLDERS if raw[name].startswith("-")), None)
        if optionlike is not None:  # `build-dir: --help` printed verify's help and passed, having checked nothing
            folder = raw[optionlike]
            raise UsageError(f"input {optionlike}: {folder!r} reads as an option, not a folder (name it ./{folder})")
        providers = tuple(dict.fromkeys(_words(raw["providers"])))
        unknown = [p for p in providers if p not in (*PROVIDERS, "all")]
        if unknown:
            raise UsageError(f"input providers: {', '.join(unknown)} unknown (choose from {', '.join(PROVIDERS)}, all)")
        gates = _words(raw["fail-on"])
        bad = [g for g in gates if g not in GATES]
        if bad:
            raise UsageError(f"input fail-on: {', '.join(bad)} unknown (choose from {', '.join(GATES)})")
        if raw["regions"] and raw["regions"] not in REGIONS:
            raise UsageError(f"input regions: {raw['regions']} unknown (choose from {', '.join(REGIONS)}, or empty)")
        try:
            timeout = check_timeout(float(raw["region-timeout"])) if raw["region-timeout"] else None
        except (ValueError, OptionError):
            limit = f"give seconds above 0 and at most {MAX_TIMEOUT_S:g}"
            raise UsageError(f"input region-timeout: {limit}, not {raw['region-timeout']!r}") from None
        try:
            shard = parse_shard(raw["shard"]) if raw["shard"] else None
        except UsageError as e:
            raise UsageError(f"input shard: {e}") from e
        try:
            MAX_SLOWDOWN.convert(raw["max-slowdown"], None, None)  # verify's own check, before any build
        except click.BadParameter as e:
            raise UsageError(f"input max-slowdown: {e.message}") from e
        return cls(
            models=Path(raw["models"]),
            build_dir=Path(raw["build-dir"]),
            providers=providers,
            shard=shard,
            golden=_flag("golden", raw["golden"]),
            fail_on=tuple(g for g in GATES if g in gates or g == "numerics"),
            max_slowdown=raw["max-slowdown"],
            regions=raw["regions"] or None,
            region_timeout=timeout,
            reports_dir=Path(raw["reports-dir"]),
        )


def report_paths(inputs: ActionInputs) -> dict[str, Path]:
    """Where the reports go: ``<reports-dir>/verify.<ext>``, or ``shard-<i>-of-<n>.<ext>`` for
    a shard, so a matrix's jobs upload theirs side by side and ``report merge shard-*.json``
    takes them all."""
    stem = "verify" if inputs.shard is None else f"shard-{inputs.shard[0]}-of-{inputs.shard[1]}"
    return {name: inputs.reports_dir / f"{stem}{ext}" for name, ext in OUTPUTS.items()}


def build_command(inputs: ActionInputs) -> list[str] | None:
    """``attn-export build``'s arguments, or None with ``golden`` (the build folder comes
    from elsewhere and torch need not be installed)."""
    return None if inputs.golden else ["build", "--models", str(inputs.models), "--out", str(inputs.build_dir)]


def verify_command(inputs: ActionInputs) -> list[str]:
    """``attn-export verify``'s arguments: the build folder, the providers, the shard, the
    reports, one option per ``fail-on`` gate (``GATES``), the region check and its run limit."""
    args = ["verify", str(inputs.build_dir)]
    args += ["--golden"] if inputs.golden else ["--models", str(inputs.models)]
    for provider in inputs.providers:
        args += ["--provider", provider]
    if inputs.shard is not None:
        args += ["--shard", f"{inputs.shard[0]}/{inputs.shard[1]}"]
    for name, path in report_paths(inputs).items():
        args += [f"--{name}", str(path)]
    for gate in inputs.fail_on:
        args += [*GATES[gate], *([inputs.max_slowdown] if gate == "latency" else [])]
    args += [f"--{inputs.regions}-regions"] if inputs.regions else []
    return args + (["--region-timeout", str(inputs.region_timeout)] if inputs.region_timeout is not None else [])


def _attn_export(args: Sequence[str]) -> int:
    """Run one attn-export command in this process, as its console script would; its exit code."""
    from attn_export.cli import cli

    print("$ attn-export " + " ".join(args), flush=True)
    try:
        cli.main(args=list(args), prog_name="attn-export")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _set_outputs(env: Mapping[str, str], outputs: Mapping[str, str]) -> None:
    """Append ``outputs`` to ``$GITHUB_OUTPUT`` in its multi-line form, with a delimiter no
    value holds (GitHub's own toolkit writes them so)."""
    path = env.get("GITHUB_OUTPUT")
    if not path:
        return
    lines = []
    for name, value in outputs.items():
        delimiter = f"ghadelimiter_{uuid.uuid4()}"
        lines += [f"{name}<<{delimiter}", value, delimiter]
    append_output(Path(path), "\n".join(lines) + "\n")


def _summary(env: Mapping[str, str], text: str) -> None:
    """Append ``text`` to the job summary as a paragraph of its own (after verify's report)."""
    path = env.get("GITHUB_STEP_SUMMARY")
    if path:
        append_output(Path(path), "\n" + text.strip("\n") + "\n")


def _check_runner_files(env: Mapping[str, str]) -> None:
    """UsageError naming the first of ``RUNNER_FILES`` that cannot be appended to (a
    directory, a FIFO, a device, no permission): checked before anything runs, since the
    step's outputs and summary go there."""
    for name in RUNNER_FILES:
        path = env.get(name)
        if not path:
            continue
        check_appended(f"${name}", Path(path))
        try:
            append_output(Path(path), "")
        except UsageError as e:
            raise UsageError(f"${name}: {e}") from e


def _outside_the_build(env: Mapping[str, str]) -> None:
    """UsageError where a runner file lies in the build folder the step builds or verifies
    (input ``build-dir``): before its build it is no build folder yet, and the step appended
    its outputs to the manifest the build then wrote."""
    build_dir = Path(env.get(PREFIX + "BUILD_DIR", "").strip() or DEFAULTS["build-dir"])
    for name in RUNNER_FILES:
        path = env.get(name)
        if path and resolved(Path(path)).is_relative_to(resolved(build_dir)):
            raise UsageError(f"${name} {path} is inside the build folder {build_dir}; point it elsewhere")


def run_action(env: Mapping[str, str]) -> int:
    """The action's main step: returns the step's exit code (0 when verify passed, else the
    failing command's: 1 a check failed, 2 bad usage or input). The outputs are written
    whatever happens, unless ``$GITHUB_OUTPUT`` itself cannot take them; ``passed`` is
    ``true`` only with exit 0."""
    try:
        _outside_the_build(env)  # first: the check of the others makes an empty file
        _check_runner_files(env)
    except AttnExportError as e:
        print(f"::error title=attn-export::{e}", flush=True)
        return e.exit_code
    try:
        from attn_export.runtimes.ort import require_provider

        inputs = ActionInputs.from_env(env)
        for provider in inputs.providers:  # a provider missing here fails now, not after the build
            if provider != "all":
                require_provider(provider)
        try:
            inputs.reports_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"input reports-dir: cannot make {inputs.reports_dir}: {e.strerror}") from e
    except AttnExportError as e:
        print(f"::error title=attn-export::{e}", flush=True)
        _summary(env, f"### attn-export: ❌ bad input\n\n{e}\n")
        _set_outputs(env, {name: "" for name in OUTPUTS} | {"passed": "false"})
        return e.exit_code
    gates = ", ".join(inputs.fail_on)
    code = 0
    build = build_command(inputs)
    if build is not None:
        print("::group::attn-export build", flush=True)
        code = _attn_export(build)
        print("::endgroup::", flush=True)
        if code:
            print(f"::error title=attn-export::build failed (exit {code}); its log is in the group above", flush=True)
            _summary(env, f"### attn-export: ❌ build failed (exit {code})\n\nThe step's log names the models.\n")
    paths = report_paths(inputs)
    for path in paths.values():  # a report an earlier run left there is not this run's
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            print(f"::error title=attn-export::input reports-dir: cannot replace {path}: {e.strerror}", flush=True)
            code = code or 2
    if code == 0:
        code = _attn_export(verify_command(inputs))  # verify appends its Markdown report to the summary
        if code == 2:
            print("::error title=attn-export::verify refused its input (exit 2); the step's log says why", flush=True)
        elif code == 3:
            print("::error title=attn-export::verify hit an internal error (exit 3); its log names it", flush=True)
        verdict = "passed" if code == 0 else f"failed (exit {code})"
        _summary(env, f"attn-export verify {verdict}; fail-on: {gates}.\n")
    reports = {name: str(path.resolve()) if path.exists() else "" for name, path in paths.items()}
    _set_outputs(env, reports | {"passed": "true" if code == 0 else "false"})
    return code


def main() -> None:
    """``python -m attn_export.github_action``: the action's step; an error writing the
    runner's files mid-run (a full disk) is one line too."""
    try:
        code = run_action(os.environ)
    except AttnExportError as e:
        print(f"::error title=attn-export::{e}", flush=True)
        code = e.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
