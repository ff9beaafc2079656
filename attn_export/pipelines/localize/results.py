"""What localize found, as data: each compared region's local error (its nodes run alone on
PyTorch's values) beside its propagated error (the whole graph's value there), and the
first region whose own error breaks the tolerance.

Where the outputs agree, a region may still break its own tolerance: a fault the outputs'
looser tolerance hides (an int8 graph's key projection a quarter off passes verify, its
attention averaging the error away). ``LocalizeReport.hidden_region`` names the first such
region, and ``LocalizeReport.passed`` is the one verdict: the case agrees, and under
``strict_regions`` no region breaks its tolerance either (``localize --strict-regions``,
``verify --strict-regions``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attn_export.checks.decode.plan import DEFAULT_STEPS
from attn_export.compare.outputs import OutputComparison
from attn_export.errors import OptionError
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.distributions import DISTRIBUTIONS
from attn_export.runtimes.ort import RUN_TIMEOUT_S, check_timeout
from attn_export.runtimes.target import DEFAULT_RUNTIME, Target

__all__ = ["LocalizeOptions", "LocalizeReport", "RegionError"]


@dataclass(frozen=True)
class LocalizeOptions:
    """Which case to localize (verify's reproduce line gives these) and where."""

    models_dir: Path = Path("models")
    sizes: Mapping[str, int] | None = None
    seed: int = 0
    distribution: str = DEFAULT_DISTRIBUTION
    mask_case: str | None = None
    provider: str = "cpu"
    #: ``onnxruntime`` (on ``provider``) or ``onnx-reference`` (the ONNX reference evaluator).
    runtime: str = DEFAULT_RUNTIME
    max_memory: int | None = None
    lock_wait_s: float = 0.0
    #: Search for the smallest case that fails at the same place (``localize.shrink``).
    shrink: bool = False
    #: Write a replay bundle of the blamed region into this new folder (``artifacts.bundle``).
    bundle: Path | None = None
    #: A decoder's step to localize, 1 being the prompt, as verify --decode numbers them;
    #: its inputs hold the cache PyTorch's steps before it fed back.
    decode_step: int | None = None
    #: The decode trajectory's padding layout (``checks.decode.plan.layouts``); default: the spec's first.
    layout: str | None = None
    #: The trajectory's length as verify --decode played it (its token data depend on it).
    decode_steps: int = DEFAULT_STEPS
    #: A causal LM's generation step to localize, 1 being the prompt, as verify --generate
    #: numbers them: its inputs hold PyTorch's own tokens and cache before it. ``layout`` is
    #: the generation's (batch-1, padded).
    generate_step: int | None = None
    #: How many tokens verify --generate asked for (its seeded prompts depend on it).
    generate_steps: int = 0
    #: The spec's ``fully_masked`` rule overridden for this case ("match" compares the
    #: padded query rows that "ignore" leaves out, to see where the two sides part there).
    fully_masked: str | None = None
    #: Localize the case ``build --record-intermediates`` recorded, on its recorded values:
    #: no torch and no checkout needed.
    golden: bool = False
    #: With ``golden``: the checkout's spec folder (``models_dir``) was named, and the recorded
    #: spec must be the one there (a stale build is refused), as verify --golden holds it.
    golden_checkout: bool = False
    #: With ``golden`` and ``spec_file``: the build folder whose recorded intermediates of the
    #: spec's graph (of ``variant``) a graph no build made is paired with, by the FX nodes its
    #: values are named for (a copy of that graph, edited by hand).
    golden_from: Path | None = None
    #: A graph no build made, localized against this spec file as a graph of ``variant``
    #: (``verify --spec``); None for built graphs.
    spec_file: Path | None = None
    variant: str = "fp32"
    #: Seconds one run of the whole graph or of one region may take on ONNX Runtime: a graph
    #: is data, and a Loop without end ran until the process was killed.
    timeout_s: float = RUN_TIMEOUT_S

    def check(self) -> None:
        """OptionError naming the first option out of its range, or two that name different
        cases, by its parameter here (``decode_step``): the Python API builds options without
        the CLI's parsing, and each face words the error with its own names for the options."""
        if self.spec_file is None and self.variant != "fp32":
            raise OptionError(
                "{variant} needs {spec_file}: a built graph's manifest names its own variant", ["variant", "spec_file"]
            )
        if self.distribution not in DISTRIBUTIONS:
            known = ", ".join(DISTRIBUTIONS)
            raise OptionError(
                f"{{distribution}} {{value!r}} is not one of {known}", ["distribution"], value=self.distribution
            )
        step, generating = self.decode_step is not None, self.generate_step is not None
        distribution = self.distribution != DEFAULT_DISTRIBUTION
        if self.layout and not (step or generating):
            raise OptionError(
                "{layout} needs {decode_step} or {generate_step}", ["layout", "decode_step", "generate_step"]
            )
        if generating and step:
            raise OptionError(
                "{generate_step} and {decode_step} name two cases: give one", ["generate_step", "decode_step"]
            )
        if generating != (self.generate_steps > 0):
            paired = "{generate_step} and {generate_steps} go together: the step, and the N of verify --generate N"
            raise OptionError(paired, ["generate_step", "generate_steps"])
        if not step and self.decode_steps != DEFAULT_STEPS:
            raise OptionError("{decode_steps} needs {decode_step}", ["decode_steps", "decode_step"])
        if step and distribution:
            unit = "{distribution} has no meaning with {decode_step}: the steps feed unit-normal tokens"
            raise OptionError(unit, ["distribution", "decode_step"])
        if step and self.shrink:
            searched = "{shrink} searches over sizes: a decode step's sizes are its trajectory's"
            raise OptionError(searched, ["shrink", "decode_step"])
        if generating and (self.shrink or distribution):
            plays = "{generate_step} plays verify --generate's steps: no {shrink} or {distribution}"
            raise OptionError(plays, ["generate_step", "shrink", "distribution"])
        if self.golden:
            self._check_golden()
        elif self.golden_from is not None:
            recorded = "{golden_from} needs {golden}: it names the build whose recorded intermediates it compares with"
            raise OptionError(recorded, ["golden_from", "golden"])
        for name, verify in (("decode_step", "--decode"), ("generate_step", "--generate")):
            if getattr(self, name) is not None and (self.sizes or self.mask_case):
                plays = (
                    f"{{{name}}} plays verify {verify}'s steps: it cannot be combined with {{sizes}} or {{mask_case}}"
                )
                raise OptionError(plays, [name, "sizes", "mask_case"])
        check_timeout(self.timeout_s, "timeout_s")

    def _check_golden(self) -> None:
        """``golden`` localizes the case the build recorded: refuse options that name another."""
        asked = {
            "sizes": self.sizes is not None,
            "seed": self.seed != 0,
            "distribution": self.distribution != DEFAULT_DISTRIBUTION,
            "mask_case": self.mask_case is not None,
            "decode_step": self.decode_step is not None,
            "generate_step": self.generate_step is not None,
            "shrink": self.shrink,
        }
        named = next((name for name, given in asked.items() if given), None)
        if named:
            recorded = f"{{golden}} localizes the case the build recorded: it cannot be combined with {{{named}}}"
            raise OptionError(recorded, ["golden", named])
        if (self.spec_file is None) != (self.golden_from is None):
            if self.spec_file is not None:
                spec = (
                    "{golden} localizes a build's recorded intermediates; a graph given with {spec_file} has none: "
                    "name the build that recorded its spec's graph with {golden_from}"
                )
                raise OptionError(spec, ["golden", "spec_file", "golden_from"])
            alone = "{golden_from} pairs a graph given with {spec_file} with a build's recording: give {spec_file}"
            raise OptionError(alone, ["golden_from", "spec_file"])

    @property
    def target(self) -> Target:
        """Where the graph runs: ONNX Runtime on ``provider``, or the reference evaluator."""
        return Target(self.runtime, self.provider if self.runtime == DEFAULT_RUNTIME else None)


@dataclass
class RegionError:
    """One region's errors against PyTorch's value of its FX node."""

    fx_node: str
    value: str
    nodes: list[str]
    ops: list[str]
    target: str
    module_path: str
    source: str
    code: str
    #: The region's nodes alone, fed PyTorch's values; None when it cannot run alone.
    local: OutputComparison | None
    #: The whole graph's value there: the region's own error plus all it inherits (None
    #: when the whole graph fails to run).
    propagated: OutputComparison | None
    #: Why ONNX Runtime would not run the region alone on PyTorch's values, if it would not.
    refused: str | None = None
    #: For a region that stands for several FX nodes (a variant's fused op, a rewrite's
    #: nodes): those FX nodes in graph order, and their distinct source lines.
    covers: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    #: The ONNX node that computes ``value`` ('' when unnamed).
    node: str = ""
    #: Inputs whose PyTorch values lie beyond the graph's dtype there (float16's 65504 in an
    #: fp16 variant, on large values): fed clipped, the region computes from values PyTorch
    #: never had, so ``local`` is shown but not its own error, and it breaks nothing.
    clipped: list[str] = field(default_factory=list)

    @property
    def breaks(self) -> bool:
        """Whether the region's own error breaks the tolerance (one fed clipped values has
        no error of its own to judge)."""
        return self.local is not None and not self.local.passed and not self.clipped

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["local"] = self.local.to_dict() if self.local else None
        d["propagated"] = self.propagated.to_dict() if self.propagated else None
        d["breaks"] = self.breaks
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegionError:
        fields = {k: v for k, v in d.items() if k != "breaks"}
        fields["local"] = OutputComparison.from_dict(d["local"]) if d["local"] else None
        fields["propagated"] = OutputComparison.from_dict(d["propagated"]) if d["propagated"] else None
        return cls(**fields)


@dataclass
class LocalizeReport:
    """One case localized: the outputs judged as verify judges them, every compared region,
    and the first whose own error breaks the tolerance (None when the case agrees)."""

    model: str
    file: str
    sizes: dict[str, int]
    seed: int
    distribution: str
    mask_case: str | None
    provider: str
    outputs: list[OutputComparison]
    regions: list[RegionError]
    #: Regions with no PyTorch value to compare (nodes without export metadata, shape arithmetic).
    uncompared: int
    first: RegionError | None = None
    #: Why ``first`` is blamed: "graph" (its own error breaks the tolerance), "refused"
    #: (ONNX Runtime will not run it alone on PyTorch's values), "module"
    #: (PyTorch itself gives NaN or Inf there first, and the graph does the same),
    #: "accumulated" (no region alone breaks it: the first value outside it, or None where
    #: the values are int4's float module, whose rounding accumulates without a fault); ''
    #: when the case agrees.
    cause: str = ""
    #: For a decoder's step: which (1 = the prompt) of which padding layout.
    decode_step: int | None = None
    layout: str | None = None
    #: For a causal LM's generation: which step (1 = the prompt) of the ``layout`` generation.
    generate_step: int | None = None
    #: With ``golden``: the recorded case's label (its sizes are ``sizes``).
    golden_case: str | None = None
    #: With ``shrink``: the sizes of the case asked for, and how many cases the search tried.
    shrunk_from: dict[str, int] | None = None
    shrink_tries: int = 0
    #: The replay bundle written, if one was asked for and a region is to blame.
    bundle: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Where the graph ran (``LocalizeOptions.runtime``).
    runtime: str = DEFAULT_RUNTIME
    reproduce: str = ""
    #: At a decoder's step: the first FX node where the module with its cache parts from
    #: one pass of itself over every token so far (a bug in the module, not the graph).
    module_bug: RegionError | None = None

    @property
    def target(self) -> Target:
        return Target(self.runtime, self.provider if self.runtime == DEFAULT_RUNTIME else None)

    @property
    def graph_agrees(self) -> bool:
        """Whether the graph gives PyTorch's outputs on the case."""
        return all(o.passed for o in self.outputs)

    @property
    def agrees(self) -> bool:
        """Whether the graph gives PyTorch's outputs and PyTorch agrees with itself."""
        return self.graph_agrees and self.module_bug is None

    @property
    def hidden_region(self) -> RegionError | None:
        """Where the graph gives PyTorch's outputs: the first region whose own error breaks
        its tolerance all the same; None where none does, or where the outputs differ
        (``first`` names the region to blame there)."""
        return next((r for r in self.regions if r.breaks), None) if self.graph_agrees else None

    def passed(self, strict_regions: bool = False) -> bool:
        """The verdict: the case agrees; with ``strict_regions``, and no region breaks its
        own tolerance where the outputs agree (default False: the outputs decide, and such
        a region is reported, not failed)."""
        return self.agrees and not (strict_regions and self.hidden_region is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "attn-export/localize-report",
            "schema_version": 1,
            **{k: v for k, v in asdict(self).items() if k not in ("outputs", "regions", "first", "module_bug")},
            "agrees": self.agrees,
            "hidden_region": self.hidden_region.to_dict() if self.hidden_region else None,
            "outputs": [o.to_dict() for o in self.outputs],
            "first": self.first.to_dict() if self.first else None,
            "module_bug": self.module_bug.to_dict() if self.module_bug else None,
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalizeReport:
        skip = {"schema", "schema_version", "agrees", "hidden_region", "outputs", "regions", "first", "module_bug"}
        return cls(
            **{k: v for k, v in d.items() if k not in skip},
            outputs=[OutputComparison.from_dict(o) for o in d["outputs"]],
            regions=[RegionError.from_dict(r) for r in d["regions"]],
            first=RegionError.from_dict(d["first"]) if d["first"] else None,
            module_bug=RegionError.from_dict(d["module_bug"]) if d.get("module_bug") else None,
        )
