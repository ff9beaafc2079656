"""What verify returns: the options it ran with, one ``CaseResult`` per (model, target, case),
one ``ModelCheck`` per model, and the ``VerifyReport`` (round-trips through JSON)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from attn_export.artifacts.files import LOCK_WAIT_S
from attn_export.artifacts.json_fields import json_field, json_object, json_record, refuse_unknown
from attn_export.artifacts.recorded import RECORDED
from attn_export.checks.decode.plan import DEFAULT_STEPS
from attn_export.checks.decode.results import DecodeResult
from attn_export.checks.generate import GenerateResult
from attn_export.compare import OutputComparison, placement_gate
from attn_export.compare.latency import noise as latency_noise
from attn_export.errors import ArtifactError, OptionError
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.scenarios import SCENARIOS
from attn_export.model_spec.shapes import format_sizes
from attn_export.runtimes import Target
from attn_export.runtimes.ort import RUN_TIMEOUT_S, check_timeout
from attn_export.runtimes.placement import Placement
from attn_export.runtimes.timing import LatencyStats

__all__ = [
    "CaseResult",
    "ModelCheck",
    "PlacementResult",
    "REGIONS",
    "Shard",
    "VerifyOptions",
    "VerifyReport",
    "judged_by",
    "verify_command",
    "runtime_versions",
    "selection_sha256",
]


#: ``VerifyOptions.regions``: ``check`` notes a region whose own error breaks its tolerance
#: though the outputs agree, ``strict`` fails the graph on it.
REGIONS = ("check", "strict")
#: How long one case is timed for by default (``VerifyOptions.latency_budget_s``).
LATENCY_BUDGET_S = 0.05
#: The settings a case is judged by, as a reproduce line gives them: flag, key, default. (Threads
#: only where timing judged it: the run records this machine's cores, and its numbers are
#: judged with PyTorch's own float32 error at them.)
_JUDGING = (
    ("--atol", "atol", None),
    ("--rtol", "rtol", None),
    ("--max-memory", "max_memory", None),
    ("--region-timeout", "region_timeout", RUN_TIMEOUT_S),
)


@dataclass
class VerifyOptions:
    """What ``attn-export verify`` was asked to do (defaults are the CLI's)."""

    targets: Sequence[Target] = (Target("onnxruntime", "cpu"),)
    #: The checkout's spec folder: PyTorch originals are rebuilt from these specs only.
    models_dir: Path = Path("models")
    golden: bool = False
    #: Golden mode with ``models_dir`` named by the user: each graph's recorded spec must be
    #: the checkout's (a folder's own manifest cannot widen its tolerance unseen).
    golden_checkout: bool = False
    shapes: Sequence[Mapping[str, int]] | None = None
    #: Value distributions to run at every shape; None: unit normal everywhere, the others
    #: at the distinct and largest shapes.
    distributions: Sequence[str] | None = None
    #: Recorded inputs (``artifacts.recorded``) to verify with instead of the sweep.
    inputs_file: Path | None = None
    n_random: int = 2
    seed: int = 0
    atol: float | None = None
    rtol: float | None = None
    latency: bool = True
    #: Threads for both PyTorch and ONNX Runtime; None means the physical cores.
    threads: int | None = None
    latency_budget_s: float = LATENCY_BUDGET_S
    max_slowdown: float | None = None
    #: Memory budget per case in bytes; None: ``model_spec.memory.memory_budget``'s default.
    max_memory: int | None = None
    #: Seconds to wait for a build of the folder in progress before giving up.
    lock_wait_s: float = LOCK_WAIT_S
    #: With ``shapes``: feed this named mask case (``masks.CASES``) instead of the pattern.
    mask_case: str | None = None
    #: Decode steps after the prompt for models with a cache; None: ``decode.DEFAULT_STEPS``
    #: unless the run is narrowed to given shapes, values or inputs; 0: no decoding.
    decode_steps: int | None = None
    #: Greedy tokens to generate for each causal LM (``checks.generate``); 0: none.
    generate_steps: int = 0
    #: Fail a target's cases when nodes ran off its provider; None: on for every provider but cpu.
    require_placement: bool | None = None
    #: A decoder scenario preset (``model_spec.scenarios.SCENARIOS``): its steps' sizes instead of the sweep.
    scenario: str | None = None
    #: A graph no build made is verified against this spec file (``verify_outside``), as a
    #: graph of ``variant`` (its name and tolerance); None for built graphs.
    spec_file: Path | None = None
    variant: str = "fp32"
    #: One of ``REGIONS``: each graph that passes has one case localized, a region over its
    #: own tolerance where the outputs agree noted (``check``) or failed (``strict``); None: no check.
    regions: str | None = None
    #: How long one run on ONNX Runtime may take before it is stopped (graphs are data): a
    #: case's run of a graph holding a Loop, and in the region check (and
    #: ``localize_failures``) a run of the whole graph or of one of its regions.
    region_timeout_s: float = RUN_TIMEOUT_S

    def check(self) -> None:
        """OptionError naming the first option out of its range, or two that cannot go
        together, by its parameter here (``seed``): the Python API builds options without the
        CLI's parsing, and each face words the error with its own names for the options."""
        for name, value in (("atol", self.atol), ("rtol", self.rtol)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise OptionError(f"{{{name}}} {{value}}: give a finite number >= 0", [name], value=value)
        if self.seed < 0:
            raise OptionError("{seed} {value}: a seed is 0 or more", ["seed"], value=self.seed)
        if not 0 <= self.n_random <= 100:
            raise OptionError("{n_random} {value}: give 0 to 100", ["n_random"], value=self.n_random)
        if self.decode_steps is not None and not 0 <= self.decode_steps <= 4096:
            raise OptionError("{decode_steps} {value}: give 0 to 4096", ["decode_steps"], value=self.decode_steps)
        if not 0 <= self.generate_steps <= 4096:
            raise OptionError("{generate_steps} {value}: give 0 to 4096", ["generate_steps"], value=self.generate_steps)
        if self.max_slowdown is not None and not (math.isfinite(self.max_slowdown) and self.max_slowdown > 0):
            raise OptionError(
                "{max_slowdown} {value}: give a finite number > 0", ["max_slowdown"], value=self.max_slowdown
            )
        if self.max_memory is not None and self.max_memory < 1:
            raise OptionError(
                "{max_memory} {value}: give a size of at least 1 byte", ["max_memory"], value=self.max_memory
            )
        if self.inputs_file and (self.shapes or self.distributions):
            sweep = "{inputs_file} replaces the sweep: it cannot be combined with {shapes} or {distributions}"
            raise OptionError(sweep, ["inputs_file", "shapes", "distributions"])
        if self.golden and (self.shapes or self.distributions):
            fixed = "{shapes} and {distributions} cannot be combined with {golden} (golden files fix their cases)"
            raise OptionError(fixed, ["shapes", "distributions", "golden"])
        if self.mask_case and not self.shapes:
            raise OptionError(
                "{mask_case} needs {shapes} (the sweep already holds every mask case)", ["mask_case", "shapes"]
            )
        if self.spec_file is None and self.variant != "fp32":
            raise OptionError(
                "{variant} needs {spec_file}: a built graph's manifest names its own variant", ["variant", "spec_file"]
            )
        if self.scenario is not None:
            if self.scenario not in SCENARIOS:
                known = ", ".join(SCENARIOS)
                raise OptionError(
                    f"{{scenario}} {{value}}: unknown (known: {known})", ["scenario"], value=self.scenario
                )
            clash = next((o for o in ("shapes", "inputs_file", "golden") if getattr(self, o)), None)
            if clash:
                raise OptionError(
                    f"{{scenario}} replaces the sweep: it cannot be combined with {{{clash}}}", ["scenario", clash]
                )
        if self.regions is not None:
            if self.regions not in REGIONS:
                known = ", ".join(REGIONS)
                raise OptionError(f"{{regions}} {{value!r}}: give one of {known}", ["regions"], value=self.regions)
            if self.golden:
                clash = "{regions} compares with PyTorch: it cannot be combined with {golden}"
                raise OptionError(clash, ["regions", "golden"])
        if self.golden and self.spec_file is not None:
            none = "{golden} compares with a build's golden file; a graph given with {spec_file} has none"
            raise OptionError(none, ["golden", "spec_file"])
        check_timeout(self.region_timeout_s, "region_timeout_s")

    def placement_required(self, target: Target) -> bool:
        """Whether ``--require-placement`` holds for ``target``."""
        if self.require_placement is not None:
            return self.require_placement
        return target.provider not in (None, "cpu")

    @property
    def steps(self) -> int:
        """The decode steps this run takes for a model with a cache."""
        if self.decode_steps is not None:
            return self.decode_steps
        narrowed = self.shapes or self.distributions or self.inputs_file or self.mask_case or self.scenario
        return 0 if narrowed else DEFAULT_STEPS

    def settings(self) -> dict[str, Any]:
        """The options as the JSON report records them."""
        return {
            "targets": [t.label for t in self.targets],
            "models": None if self.golden and not self.golden_checkout else str(self.models_dir),
            "golden": self.golden,
            "threads": self.threads,
            "latency": self.latency,
            "latency_budget": self.latency_budget_s,
            "random": self.n_random,
            "atol": self.atol,
            "rtol": self.rtol,
            "max_slowdown": self.max_slowdown,
            "max_memory": self.max_memory,
            "shapes": [dict(s) for s in self.shapes] if self.shapes else None,
            "distributions": list(self.distributions) if self.distributions else None,
            "inputs": str(self.inputs_file) if self.inputs_file else None,
            "mask_case": self.mask_case,
            "decode_steps": self.steps,
            "generate_steps": self.generate_steps,
            "require_placement": self.require_placement,
            "scenario": self.scenario,
            "regions": self.regions,
            # only where set: a report from before it was recorded merges with one at the default
            **({"region_timeout": self.region_timeout_s} if self.region_timeout_s != RUN_TIMEOUT_S else {}),
            **({"spec": str(self.spec_file), "variant": self.variant} if self.spec_file else {}),
        }


@dataclass
class CaseResult:
    """One model x target x shape: numbers, errors and timings."""

    model: str
    target: Target
    shape: str
    sizes: dict[str, int]
    seed: int
    expected_from: str  # "torch[cpu]", "torch[cuda]" or "golden"
    comparisons: list[OutputComparison] = field(default_factory=list)
    error: str | None = None
    torch_latency: LatencyStats | None = None
    onnx_latency: LatencyStats | None = None
    gate: str | None = None
    #: The float inputs' value distribution (``model_spec.distributions``), or "recorded".
    distribution: str = DEFAULT_DISTRIBUTION
    #: What the report must say beside the numbers (what fully masked rows give, rows left out).
    notes: list[str] = field(default_factory=list)
    #: Why the target's nodes ran off its provider under ``--require-placement``, or None.
    placement_gate: str | None = None

    @property
    def runtime(self) -> str:
        return self.target.label

    @property
    def ratio(self) -> float | None:
        if self.torch_latency and self.onnx_latency and self.torch_latency.p50_ms > 0:
            return self.onnx_latency.p50_ms / self.torch_latency.p50_ms
        return None

    @property
    def noise(self) -> str | None:
        """Why this case's timings are too noisy to decide on, or None."""
        return latency_noise(self.onnx_latency, self.torch_latency)

    @property
    def max_abs_error(self) -> float | None:
        """The largest absolute error over outputs; None when nothing numeric was compared."""
        numeric = [c for c in self.comparisons if c.numeric]
        return max((c.max_abs_error for c in numeric), default=None) if numeric == self.comparisons else None

    @property
    def max_rel_error(self) -> float | None:
        numeric = [c for c in self.comparisons if c.numeric]
        measured = [c.max_rel_error for c in numeric if c.max_rel_error is not None]
        return max(measured, default=None) if numeric == self.comparisons else None

    @property
    def compared_nothing(self) -> bool:
        """Whether every element of every output is one the spec leaves out (``fully_masked =
        "ignore"``): such a case proves nothing. Outputs empty at a size the spec allows
        (``min = 0``) prove their shapes, which is all there is."""
        empty = all(0 in c.expected_shape for c in self.comparisons)
        return sum(c.total for c in self.comparisons) == 0 and not empty

    @property
    def passed(self) -> bool:
        gates = self.gate is None and self.placement_gate is None
        ok = all(c.passed for c in self.comparisons) and not self.compared_nothing
        return self.error is None and gates and ok

    def reasons(self) -> list[str]:
        out = [self.error] if self.error else []
        out += [c.reason() for c in self.comparisons if not c.passed]
        if not out and self.compared_nothing:
            out.append(
                'compared no element: every element is one the spec leaves out (fully_masked = "ignore"), which '
                "proves nothing"
            )
        return out + [g for g in (self.gate, self.placement_gate) if g]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "runtime": self.runtime,
            "target": self.target.to_dict(),
            "shape": self.shape,
            "sizes": self.sizes,
            "seed": self.seed,
            "expected_from": self.expected_from,
            "distribution": self.distribution,
            "passed": self.passed,
            "error": self.error,
            "gate": self.gate,
            "placement_gate": self.placement_gate,
            "notes": self.notes,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "latency": None
            if self.onnx_latency is None
            else {
                "onnx": self.onnx_latency.to_dict(),
                "torch": self.torch_latency.to_dict() if self.torch_latency else None,
                "ratio": self.ratio,
                "noise": self.noise,
            },
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "case") -> CaseResult:
        """The case ``to_dict`` wrote; ArtifactError naming the first field (``where.seed``)
        not of its type: a case is read from a shard's report, which can come from anywhere."""
        d = json_object(d, where)
        lat = json_field(d, "latency", dict | None, where, None) or {}
        timing = {k: json_field(lat, k, dict | None, f"{where}.latency", None) for k in ("onnx", "torch")}
        stats = {k: json_record(LatencyStats, t, f"{where}.latency.{k}") if t else None for k, t in timing.items()}
        result = cls(
            model=json_field(d, "model", str, where),
            target=Target.of_result(d, where),
            shape=json_field(d, "shape", str, where),
            sizes=dict(json_field(d, "sizes", dict[str, int], where)),
            seed=json_field(d, "seed", int, where),
            expected_from=json_field(d, "expected_from", str, where),
            distribution=json_field(d, "distribution", str, where),
            comparisons=[
                OutputComparison.from_dict(c, f"{where}.comparisons[{i}]")
                for i, c in enumerate(json_field(d, "comparisons", list, where))
            ],
            error=json_field(d, "error", str | None, where, None),
            gate=json_field(d, "gate", str | None, where, None),
            placement_gate=json_field(d, "placement_gate", str | None, where, None),
            notes=list(json_field(d, "notes", list[str], where, [])),
            onnx_latency=stats["onnx"],
            torch_latency=stats["torch"],
        )
        refuse_unknown(d, {*result.to_dict(), "reproduce"}, where)  # the report adds its reproduce line
        return result


@dataclass
class ModelCheck:
    """Per-model checks that come before any run: artifact integrity and graph axes; and
    what they found that fails nothing (``notes``)."""

    model: str
    file: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def runtime_versions() -> dict[str, str]:
    """The versions that shape verify's numbers, read without importing anything new
    (``verify --golden`` runs without torch)."""
    import numpy
    import onnx
    import onnxruntime

    from attn_export import __version__

    found = {"attn_export": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    found["numpy"] = numpy.__version__
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found["torch"] = importlib.metadata.version("torch")
    return found


@dataclass(frozen=True)
class Shard:
    """Which shard of a sharded run a report is (``--shard i/n``), and of which selection
    of models: ``report merge`` puts the n shards of one selection back together."""

    index: int
    count: int
    #: sha256 of the sorted names of every model the n shards verify between them.
    selection: str

    @classmethod
    def of(cls, names: Sequence[str], shard: tuple[int, int]) -> Shard:
        return cls(shard[0], shard[1], selection_sha256(names))

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def selection_sha256(names: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


@dataclass
class PlacementResult:
    """Where one model's graph ran on one target (``runtimes.placement``), judged by
    ``compare.placement_gate`` where ``--require-placement`` holds."""

    model: str
    target: Target
    placement: Placement
    required: bool

    @property
    def runtime(self) -> str:
        return self.target.label

    @property
    def gate(self) -> str | None:
        return placement_gate(self.placement, self.required)

    @property
    def passed(self) -> bool:
        return self.gate is None

    @property
    def verdict(self) -> str:
        """PASS, FAIL (under ``--require-placement``), or WARN: nodes fell back or the
        placement could not be read, and nothing required it."""
        if not self.passed:
            return "FAIL"
        return "WARN" if self.placement.fallbacks or self.placement.error else "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "runtime": self.runtime,
            "target": self.target.to_dict(),
            "required": self.required,
            "passed": self.passed,
            **self.placement.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "placement") -> PlacementResult:
        """The placement ``to_dict`` wrote; ArtifactError naming the first field not of its type."""
        d = json_object(d, where)
        model, target = json_field(d, "model", str, where), Target.of_result(d, where)
        result = cls(model, target, Placement.from_dict(d, where), json_field(d, "required", bool, where))
        refuse_unknown(d, result.to_dict(), where)
        return result


def judged_by(settings: Mapping[str, Any], timed: bool) -> list[str]:
    """The options a run's ``settings`` judged by where they are not the defaults: without them
    a reproduce line would rerun another check (a case failing under ``--atol`` judged at the
    spec's tolerance). Timing is left out unless the latency gate judged (``timed``)."""
    args: list[str] = []
    for flag, key, default in _JUDGING:
        if settings.get(key) not in (None, default):
            args += [flag, str(settings[key])]
    placement = settings.get("require_placement")
    if placement is not None:
        args += ["--require-placement" if placement else "--no-require-placement"]
    if not timed:
        return [*args, "--no-latency"]
    budget = settings.get("latency_budget", LATENCY_BUDGET_S)
    gate = ["--max-slowdown", str(settings.get("max_slowdown"))]
    gate += ["--threads", str(settings["threads"])] if settings.get("threads") else []  # timings move by it
    return [*args, *gate, *(["--latency-budget", str(budget)] if budget != LATENCY_BUDGET_S else [])]


def verify_command(args: Sequence[str], settings: Mapping[str, Any], timed: bool) -> str:
    """``attn-export verify ARGS`` with the options ``settings`` judged by (``judged_by``), quoted."""
    return "attn-export verify " + " ".join(shlex.quote(a) for a in [*args, *judged_by(settings, timed)])


@dataclass
class VerifyReport:
    """Everything one verify run found; the JSON report is ``to_dict``."""

    #: What the JSON report's "schema" field says.
    SCHEMA: ClassVar[str] = "attn-export/verify-report"

    artifacts: str
    seed: int
    settings: dict[str, Any]
    checks: list[ModelCheck] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)
    #: Decoding trajectories of the models with a cache.
    decode: list[DecodeResult] = field(default_factory=list)
    #: Greedy generations of the causal LMs (``--generate``), by runner and prompt layout.
    generate: list[GenerateResult] = field(default_factory=list)
    #: Where each model's graph ran on each target with execution providers.
    placement: list[PlacementResult] = field(default_factory=list)
    seconds: float = 0.0
    #: The build verified (``Manifest.sha256``); None in reports written before it was recorded.
    manifest_sha256: str | None = None
    #: The versions that shaped the numbers (``runtime_versions``).
    versions: dict[str, str] = field(default_factory=dict)
    #: Which shard of a ``--shard i/n`` run this is; None for a whole run (and a merged one).
    shard: Shard | None = None

    @property
    def passed(self) -> bool:
        return (
            self.compared
            and all(c.passed for c in self.checks)
            and all(c.passed for c in self.cases)
            and all(d.passed for d in self.decode)
            and all(g.passed for g in self.generate)
            and all(p.passed for p in self.placement)
        )

    @property
    def compared(self) -> bool:
        """Whether any case or decode step ran: a verify that compared nothing proves nothing."""
        return bool(self.cases or self.decode or self.generate)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def failed_cases(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    @property
    def failed_models(self) -> list[str]:
        failed = {c.model for c in self.failed_cases} | {d.model for d in self.decode if not d.passed}
        failed |= {g.model for g in self.generate if not g.passed}
        failed |= {p.model for p in self.placement if not p.passed}
        return sorted(failed | {c.model for c in self.checks if not c.passed})

    @property
    def errors_by_distribution(self) -> dict[tuple[str, str], dict[str, float | None]]:
        """Largest absolute error per (model, runtime) and value distribution; None where
        no number was compared."""
        out: dict[tuple[str, str], dict[str, float | None]] = {}
        for c in self.cases:
            errors = out.setdefault((c.model, c.runtime), {})
            worst = errors.get(c.distribution)
            value = c.max_abs_error
            errors[c.distribution] = value if worst is None else (worst if value is None else max(worst, value))
        return out

    @property
    def summary(self) -> dict[str, int]:
        return {
            "models": len(self.checks),
            "cases": len(self.cases),
            "failed_cases": len(self.failed_cases),
            "failed_checks": sum(not c.passed for c in self.checks),
            "noisy_timings": sum(c.noise is not None for c in self.cases),
            **(
                {"decode_trajectories": len(self.decode), "failed_trajectories": sum(not d.passed for d in self.decode)}
                if self.decode
                else {}
            ),
            **(
                {"generations": len(self.generate), "failed_generations": sum(not g.passed for g in self.generate)}
                if self.generate
                else {}
            ),
            **(
                {
                    "placement_fallbacks": sum(bool(p.placement.fallbacks) for p in self.placement),
                    "failed_placements": sum(not p.passed for p in self.placement),
                }
                if self.placement
                else {}
            ),
        }

    def models(self) -> list[str]:
        return [c.model for c in self.checks]

    def reproduce(self, case: CaseResult) -> str:
        """The one command that reruns exactly this case."""
        args = self._graph(case.model, case.target)
        if case.distribution == RECORDED:
            args += ["--inputs", str(self.settings.get("inputs"))]
        if case.expected_from == "golden":
            args += ["--golden"]
        elif case.distribution != RECORDED:
            shape = format_sizes(case.sizes)
            args += ["--shapes", shape, "--seed", str(case.seed), "--distribution", case.distribution]
            args += ["--mask-case", case.shape] if case.shape in CASES else []
        return self._command(args, timed=case.gate is not None)

    def reproduce_decode(self, trajectory: DecodeResult) -> str:
        """The command that reruns ``trajectory``: its model's run at this seed and number of
        steps, which seed the trajectories (the model's cases run again beside them), and the
        scenario it belongs to."""
        args = self._graph(trajectory.model, trajectory.target)
        scenario = self.settings.get("scenario")  # which decodes only where --decode is given too
        args += ["--scenario", scenario] if scenario else []
        args += ["--decode", str(self.settings.get("decode_steps", DEFAULT_STEPS))]
        args += ["--golden"] if trajectory.expected_from == "golden" else ["--seed", str(self.seed)]
        return self._command(args, timed=False)

    def reproduce_generation(self, generation: GenerateResult) -> str:
        """The command that reruns ``generation``: its model's generations at this seed (which
        draws the prompts) and length, on the target that ran it (onnxruntime-genai's
        generator runs beside whichever), without the decode trajectories."""
        targets = {t.label: t for t in [*(c.target for c in self.cases), *(d.target for d in self.decode)]}
        target = targets.get(generation.runner)
        args = self._graph(generation.model, target)
        args += ["--generate", str(generation.steps), "--decode", "0"]
        args += ["--golden"] if self.settings.get("golden") else ["--seed", str(self.seed)]
        return self._command(args, timed=False)

    def _graph(self, model: str, target: Target | None) -> list[str]:
        """The arguments naming ``model``'s graph, the target and the specs it is judged by."""
        file = next(c.file for c in self.checks if c.model == model)
        args = [str(Path(self.artifacts) / file), *(target.cli_args() if target else [])]
        models, spec = self.settings.get("models"), self.settings.get("spec")
        if spec:  # a graph no build made
            variant = self.settings["variant"]
            args += ["--spec", spec, *(["--variant", variant] if variant != "fp32" else [])]
        elif models and (models != "models" or self.settings.get("golden")):  # verify's default, but in
            # golden mode a folder named at all turns the stale check on
            args += ["--models", models]
        return args

    def _command(self, args: list[str], timed: bool) -> str:
        return verify_command(args, self.settings, timed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.SCHEMA,
            "schema_version": 1,
            "artifacts": self.artifacts,
            "seed": self.seed,
            "settings": self.settings,
            "manifest_sha256": self.manifest_sha256,
            "versions": self.versions,
            "shard": dataclasses.asdict(self.shard) if self.shard else None,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "summary": self.summary,
            "checks": [dataclasses.asdict(c) | {"passed": c.passed} for c in self.checks],
            "cases": [c.to_dict() | {"reproduce": self.reproduce(c)} for c in self.cases],
            "decode": [d.to_dict() for d in self.decode],
            "generate": [g.to_dict() for g in self.generate],
            "placement": [p.to_dict() for p in self.placement],
        }

    @classmethod
    def from_dict(cls, d: Any) -> VerifyReport:
        """The report ``to_dict`` wrote (``report merge`` reads shards' from anywhere); ArtifactError
        naming the first field not of its type (``cases[0].seed: a string, not int``), never
        a silent conversion (``dict`` of a list of pairs, ``list`` of a string's letters)."""
        d = json_object(d, "the report")
        shard = json_field(d, "shard", dict | None, "", None)
        found = {k: json_field(d, k, list, "", []) for k in ("decode", "generate", "placement")}
        return cls(
            artifacts=json_field(d, "artifacts", str),
            seed=json_field(d, "seed", int),
            settings=dict(json_field(d, "settings", dict[str, Any])),
            manifest_sha256=json_field(d, "manifest_sha256", str | None, "", None),
            versions=dict(json_field(d, "versions", dict[str, str] | None, "", None) or {}),
            shard=None if not shard else _shard(shard),
            checks=[_check(c, f"checks[{i}]") for i, c in enumerate(json_field(d, "checks", list))],
            cases=[CaseResult.from_dict(c, f"cases[{i}]") for i, c in enumerate(json_field(d, "cases", list))],
            decode=[DecodeResult.from_dict(t, f"decode[{i}]") for i, t in enumerate(found["decode"])],
            generate=[GenerateResult.from_dict(g, f"generate[{i}]") for i, g in enumerate(found["generate"])],
            placement=[PlacementResult.from_dict(p, f"placement[{i}]") for i, p in enumerate(found["placement"])],
            seconds=json_field(d, "seconds", float),
        )


def _shard(d: Mapping[str, Any]) -> Shard:
    """A report's shard, its index one of its count's: a report is data from anywhere."""
    index, count = json_field(d, "index", int, "shard"), json_field(d, "count", int, "shard")
    if not 1 <= index <= count:
        raise ArtifactError(f"shard: index {index} is not one of 1..{count}")
    return Shard(index, count, json_field(d, "selection", str, "shard"))


def _check(d: Any, where: str) -> ModelCheck:
    """A ``checks`` entry of a report, each field checked."""
    d = json_object(d, where)
    problems, notes = json_field(d, "problems", list[str], where), json_field(d, "notes", list[str], where, [])
    return ModelCheck(
        json_field(d, "model", str, where), json_field(d, "file", str, where), list(problems), list(notes)
    )
