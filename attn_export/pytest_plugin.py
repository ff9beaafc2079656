"""pytest plugin (entry point ``pytest11``): ``pytest --attn-export BUILD_DIR`` collects one
test per model x target x case of a build folder, each judged as ``attn-export verify``
judges it, a failure showing its numbers and the command that reproduces it.

Each model is verified once, when its first test runs. Without the option the plugin does
nothing and imports nothing heavy. For a user's own tests, see
``attn_export.assert_onnx_matches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from attn_export.pipelines.verify import CaseResult, VerifyReport
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


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for folder in config.getoption("attn_export"):
        manifest = Path(folder).resolve() / "manifest.json"
        items.extend(BuildFolder.from_parent(session, path=manifest).collect())


class _CaseFailed(Exception):
    """Raised by a case that failed verify, carrying what pytest prints."""


class BuildFolder(pytest.File):
    """A build folder's manifest: one item per model x target x case of verify's sweep."""

    def collect(self) -> Iterator[CaseItem]:
        from attn_export.artifacts.manifest import load_manifest
        from attn_export.checks.decode import layouts
        from attn_export.errors import AttnExportError, UsageError
        from attn_export.pipelines.verify import VerifyOptions, case_plan, checkout_spec
        from attn_export.runtimes import RUNTIMES, resolve_targets
        from attn_export.spec.cache import cache_of
        from attn_export.spec.distributions import case_label
        from attn_export.spec.memory import parse_bytes

        config = self.config
        try:
            seed, budget = config.getoption("attn_export_seed"), config.getoption("attn_export_max_memory")
            if seed < 0:
                raise UsageError(f"--attn-export-seed {seed}: a seed is 0 or more")
            self.manifest = load_manifest(self.path.parent)
            targets = resolve_targets(["onnxruntime"], config.getoption("attn_export_provider") or ["cpu"])
            self.options = VerifyOptions(
                targets=targets,
                models_dir=Path(config.getoption("attn_export_models")),
                seed=seed,
                latency=False,
                max_memory=None if budget is None else parse_bytes(budget, "--attn-export-max-memory"),
            )
            models = sorted(self.manifest.models)
            specs = [
                checkout_spec(self.options.models_dir, self.manifest.models[m], "--attn-export-models") for m in models
            ]
        except AttnExportError as e:
            raise pytest.UsageError(f"--attn-export: {e}") from e
        self.reports: dict[str, VerifyReport | str] = {}
        for model, spec in zip(models, specs, strict=True):
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
        line, as the CLI says it, never with a traceback."""
        from attn_export.errors import AttnExportError
        from attn_export.pipelines.verify import verify_artifacts

        if model not in self.reports:
            try:
                self.reports[model] = verify_artifacts(self.path.parent, self.manifest, [model], self.options)
            except AttnExportError as e:
                self.reports[model] = str(e)
        found = self.reports[model]
        if isinstance(found, str):
            reproduce = f"attn-export verify {self.path.parent} --models {self.options.models_dir}"
            raise _CaseFailed(f"{found}\nreproduce: {reproduce}")
        return found


class CaseItem(pytest.Item):
    """One model x target x case; passes when verify's case passed."""

    def __init__(self, *, model: str, target: Target, case: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model, self.target, self.case = model, target, case

    def runtest(self) -> None:
        from attn_export.spec.distributions import case_label

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
        if lines:
            raise _CaseFailed("\n".join(lines))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, _CaseFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"attn-export verify: {self.name}"


def _describe(case: CaseResult, report: VerifyReport) -> list[str]:
    from attn_export.spec.shapes import format_sizes

    sizes = format_sizes(case.sizes)
    lines = [f"{case.model} {case.runtime} {case.shape} ({sizes}, seed {case.seed}):"]
    lines += [f"  {reason}" for reason in case.reasons()]
    lines += [f"  note: {note}" for note in case.notes]
    return [*lines, f"reproduce: {report.reproduce(case)}"]
