"""pytest plugin (entry point ``pytest11``): ``pytest --attn-export BUILD_DIR`` collects one
test per model x target x case of a build folder, each judged as ``attn-export verify``
judges it, a failure showing its numbers and the command that reproduces it.

Each folder's manifest is collected as a file named on the command line (its cases are
counted and selected with -k as any test, each node id naming the folder); each model is
verified once, when its first test runs. Without the option the plugin does nothing and
imports nothing heavy. For a user's own tests, see
``attn_export.assert_onnx_matches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from attn_export.artifacts.manifest import Manifest
    from attn_export.model_spec import ModelSpec
    from attn_export.pipelines.verify import CaseResult, VerifyOptions, VerifyReport
    from attn_export.runtimes import Target

__all__ = ["BuildFolder", "CaseItem"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn-export")
    group.addoption(
        "--attn-export",
        action="append",
        default=[],
        metavar="BUILD_DIR",
        help="Verify an attn-export build folder: one test per model x target x case (repeatable).",
    )
    group.addoption(
        "--attn-export-models",
        default="models",
        metavar="DIR",
        help="The checkout's spec folder, as verify --models: PyTorch originals are rebuilt from it.",
    )
    group.addoption("--attn-export-seed", type=int, default=0, metavar="N", help="Seed, as verify --seed.")
    group.addoption(
        "--attn-export-max-memory",
        metavar="SIZE",
        help="Memory budget per case, as verify --max-memory (e.g. 8GiB); a case over it fails, one line.",
    )
    group.addoption(
        "--attn-export-provider",
        action="append",
        default=[],
        metavar="NAME",
        help="ONNX Runtime provider (repeatable; default cpu), as verify --provider.",
    )
    group.addoption(
        "--attn-export-regions",
        metavar="check|strict",
        help="Localize one case of each model that passes: check warns (Notice) of a region over its own "
        "tolerance though the outputs agree, strict fails the model's cases on it; as verify --check-regions, "
        "--strict-regions.",
    )
    group.addoption(
        "--attn-export-region-timeout",
        type=float,
        metavar="SECONDS",
        help="Stop a run on ONNX Runtime after this many seconds (a graph's Loop, a region), as verify "
        "--region-timeout.",
    )


def _manifests(config: pytest.Config) -> list[Path]:
    from attn_export.artifacts.files import resolved

    return [resolved(Path(folder)) / "manifest.json" for folder in config.getoption("attn_export")]


@dataclass
class _Folder:
    """What a build folder's tests need, read once its options are checked."""

    manifest: Manifest
    options: VerifyOptions
    specs: dict[str, ModelSpec]


_FOLDERS = pytest.StashKey[dict[Path, _Folder]]()


def pytest_configure(config: pytest.Config) -> None:
    """Each build folder's manifest joins the paths pytest collects, as a file given on its
    command line: its cases are counted, selected (-k) and named (the folder in each node
    id) as any test is. Bad options, manifests and specs are a usage error, here."""
    if not config.getoption("attn_export"):
        return
    from attn_export.errors import AttnExportError

    try:
        manifests = _manifests(config)
        config.stash[_FOLDERS] = {m: _read_folder(config, m) for m in manifests}
    except AttnExportError as e:
        raise pytest.UsageError(f"--attn-export: {e}") from e
    for manifest in manifests:
        if str(manifest) not in config.args:
            config.args.append(str(manifest))


def _read_folder(config: pytest.Config, path: Path) -> _Folder:
    from attn_export.artifacts.manifest import load_manifest
    from attn_export.errors import OptionError, UsageError
    from attn_export.model_spec.memory import parse_bytes
    from attn_export.pipelines.verify import VerifyOptions, checkout_spec
    from attn_export.runtimes import resolve_targets
    from attn_export.runtimes.base import RUN_TIMEOUT_S

    seed, budget = config.getoption("attn_export_seed"), config.getoption("attn_export_max_memory")
    timeout = config.getoption("attn_export_region_timeout")
    options = VerifyOptions(
        targets=resolve_targets(["onnxruntime"], config.getoption("attn_export_provider") or ["cpu"]),
        models_dir=Path(config.getoption("attn_export_models")),
        seed=seed,
        latency=False,
        max_memory=None if budget is None else parse_bytes(budget, "--attn-export-max-memory"),
        regions=config.getoption("attn_export_regions"),
        region_timeout_s=RUN_TIMEOUT_S if timeout is None else timeout,
    )
    try:
        options.check()
    except OptionError as e:
        names = {"seed": "--attn-export-seed", "regions": "--attn-export-regions"}
        raise UsageError(e.named(names | {"region_timeout_s": "--attn-export-region-timeout"})) from e
    manifest = load_manifest(path.parent)
    models = sorted(manifest.models)
    specs = {m: checkout_spec(options.models_dir, manifest.models[m], "--attn-export-models") for m in models}
    return _Folder(manifest, options, specs)


@pytest.hookimpl(tryfirst=True)
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A build folder, and each folder above it, is walked into though pytest skips any
    folder named ``build`` by default (``norecursedirs``)."""
    here = collection_path.resolve()
    return False if any(m.parent.is_relative_to(here) for m in config.stash.get(_FOLDERS, {})) else None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> BuildFolder | None:
    if file_path.name == "manifest.json" and file_path.resolve() in parent.config.stash.get(_FOLDERS, {}):
        return BuildFolder.from_parent(parent, path=file_path)
    return None


class _CaseFailed(Exception):
    """Raised by a case that failed verify, carrying what pytest prints."""


class BuildFolder(pytest.File):
    """A build folder's manifest: one item per model x target x case of verify's sweep."""

    def collect(self) -> Iterator[CaseItem]:
        from attn_export.checks.decode.plan import layouts
        from attn_export.errors import AttnExportError
        from attn_export.model_spec.cache import cache_of
        from attn_export.model_spec.distributions import case_label
        from attn_export.pipelines.verify import case_plan
        from attn_export.runtimes import RUNTIMES

        folder = self.config.stash[_FOLDERS][self.path.resolve()]
        self.manifest, self.options = folder.manifest, folder.options
        targets = self.options.targets
        self.reports: dict[str, VerifyReport | str] = {}
        for model, spec in folder.specs.items():
            for target in targets:
                try:
                    plan = case_plan(spec, self.options, RUNTIMES[target.runtime].shape_cap)
                except AttnExportError as e:  # a case over the budget: the model fails, in one line
                    self.reports[model] = str(e)
                    yield CaseItem.from_parent(
                        self,
                        name=f"{model}[{target.runtime}-{target.provider}]",
                        model=model,
                        target=target,
                        case="plan",
                    )
                    continue
                for point, distribution in plan:
                    label = case_label(point.label, distribution)
                    name = f"{model}[{target.runtime}-{target.provider}-{label}]"
                    yield CaseItem.from_parent(self, name=name, model=model, target=target, case=label)
                cache = cache_of(spec)
                for scenario in layouts(spec, cache) if cache is not None and self.options.steps else []:
                    label = f"decode-{scenario}"
                    name = f"{model}[{target.runtime}-{target.provider}-{label}]"
                    yield CaseItem.from_parent(self, name=name, model=model, target=target, case=label)

    def report(self, model: str) -> VerifyReport:
        """verify's report for one model, made when its first case runs; a model verify
        cannot run (a corrupt graph, a case over the budget) fails each of its cases in one
        line, as the CLI says it, never with a traceback. What the CLI notes beside a
        model's rows (a region over its tolerance where the outputs agree) is a ``Notice``
        warning of the test that made the report."""
        from attn_export.errors import AttnExportError, notify
        from attn_export.pipelines.verify import verify_artifacts

        if model not in self.reports:
            try:
                report = verify_artifacts(self.path.parent, self.manifest, [model], self.options, on_notice=notify)
            except AttnExportError as e:
                self.reports[model] = str(e)
            else:
                self.reports[model] = report
                for note in (n for check in report.checks for n in check.notes):
                    notify(note)
        found = self.reports[model]
        if isinstance(found, str):
            raise _CaseFailed(f"{found}\nreproduce: {self._reproduce(model)}")
        return found

    def _reproduce(self, model: str) -> str:
        """The command that verifies ``model`` as this run did: its seed, targets and limits."""
        from attn_export.pipelines.verify.results import verify_command

        options = self.options
        args = [str(self.path.parent / self.manifest.models[model].file), "--models", str(options.models_dir)]
        args += [a for target in options.targets for a in target.cli_args()] + ["--seed", str(options.seed)]
        return verify_command(args, options.settings(), timed=False)


class CaseItem(pytest.Item):
    """One model x target x case; passes when verify's case passed."""

    def __init__(self, *, model: str, target: Target, case: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model, self.target, self.case = model, target, case

    def runtest(self) -> None:
        from attn_export.model_spec.distributions import case_label

        assert isinstance(self.parent, BuildFolder)
        report = self.parent.report(self.model)
        lines = [f"FAIL {p}" for check in report.checks for p in check.problems]
        case = next(
            (c for c in report.cases if c.target == self.target and case_label(c.shape, c.distribution) == self.case),
            None,
        )
        decode = next(
            (d for d in report.decode if d.target == self.target and f"decode-{d.scenario}" == self.case), None
        )
        if case is None and decode is None and not lines:
            lines.append(f"{self.model}: verify ran no case '{self.case}' on {self.target.label}")
        if case is not None and (lines or not case.passed):
            lines += _describe(case, report)
        if decode is not None and not decode.passed:
            lines += [f"{self.model} {decode.runtime} decode {decode.scenario}: {r}" for r in decode.reasons()]
            lines += [f"reproduce: {report.reproduce_decode(decode)}"]
        if lines:
            raise _CaseFailed("\n".join(lines))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, _CaseFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"attn-export verify: {self.name}"


def _describe(case: CaseResult, report: VerifyReport) -> list[str]:
    from attn_export.model_spec.shapes import format_sizes

    sizes = format_sizes(case.sizes)
    lines = [f"{case.model} {case.runtime} {case.shape} ({sizes}, seed {case.seed}):"]
    lines += [f"  {reason}" for reason in case.reasons()]
    lines += [f"  note: {note}" for note in case.notes]
    return [*lines, f"reproduce: {report.reproduce(case)}"]
