"""What a build returns: one ``BuildResult`` per graph with the stage it failed at, and the
``BuildSummary`` of a run (round-trips through JSON)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from attn_export.artifacts.files import LOCK_WAIT_S
from attn_export.artifacts.targets import TARGETS
from attn_export.errors import OptionError, UsageError
from attn_export.model_spec import EXPORTERS, variant_chain
from attn_export.runtimes.target import PROVIDERS

__all__ = ["STAGES", "STATUSES", "BuildOptions", "BuildResult", "BuildStatus", "BuildSummary"]

#: In the order a failure is reported by (``failed_stage``): the smoke check runs after
#: fully masked rows are settled, but where both fail, the smoke check's failure says more.
STAGES = (
    "spec",
    "module",
    "masks",
    "export",
    "variant",
    "checker",
    "axes",
    "load",
    "golden",
    "smoke",
    "fully_masked",
    "write",
)
BuildStatus = Literal["built", "skipped", "failed"]
STATUSES: tuple[BuildStatus, ...] = ("built", "skipped", "failed")


@dataclass
class BuildOptions:
    """What ``attn-export build`` was asked to do."""

    out_dir: Path
    opset: int | None = None
    exporter: str | None = None
    force: bool = False
    fail_fast: bool = False
    #: Graph variants to build (keys of ``model_spec.VARIANTS``, or chains of them: ``ort-past+int8``).
    variants: tuple[str, ...] = ("fp32",)
    #: Provider that ``ort-optimized`` optimizes for and ``auto`` times on.
    provider: str = "cpu"
    #: Seconds to wait for another build to release the output folder.
    lock_wait_s: float = LOCK_WAIT_S
    #: Memory budget per case in bytes (``model_spec.memory.memory_budget``); None: the default.
    max_memory: int | None = None
    #: Also write PyTorch's value of every FX node on the smallest golden case, so that
    #: ``localize --golden`` runs where torch is not installed.
    record_intermediates: bool = False
    #: What the build folder is made for (``TARGETS``): ``onnx``, the graphs alone; ``genai``,
    #: each graph also as a folder onnxruntime-genai loads as it is (``genai/<graph>/``).
    target: str = "onnx"
    #: Keep each failure's traceback in its result (``attn-export --debug``): a model's
    #: failure is a line of the summary, not an error the command raises.
    debug: bool = False

    def check(self) -> None:
        """OptionError naming the first option out of its range by its parameter here
        (``opset``): the Python API builds options without the CLI's parsing, and each face
        words the error with its own names for the options."""
        if self.opset is not None and not 7 <= self.opset <= 30:
            raise OptionError("{opset} {value}: give 7 to 30", ["opset"], value=self.opset)
        if self.exporter is not None and self.exporter not in EXPORTERS:
            exporters = " or ".join(EXPORTERS)
            raise OptionError(f"{{exporter}} {{value}}: choose {exporters}", ["exporter"], value=self.exporter)
        for variant in self.variants:
            variant_chain(variant)  # an impossible chain is refused before anything is exported
        if self.provider not in PROVIDERS:
            raise UsageError(f"unknown provider {self.provider} (known: {', '.join(PROVIDERS)})")
        if not (math.isfinite(self.lock_wait_s) and self.lock_wait_s >= 0):
            raise OptionError(
                "{lock_wait_s} {value}: give a finite number >= 0", ["lock_wait_s"], value=self.lock_wait_s
            )
        if self.max_memory is not None and self.max_memory < 1:
            raise OptionError(
                "{max_memory} {value}: give a size of at least 1 byte", ["max_memory"], value=self.max_memory
            )
        if self.target not in TARGETS:
            raise UsageError(f"unknown target {self.target} (known: {', '.join(TARGETS)})")
        if self.target == "genai" and any(variant_chain(v).chooser for v in self.variants):
            named = "{target} genai packages the graphs asked for by name: name the variant, not auto"
            raise OptionError(named, ["target"])
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise UsageError(f"cannot use output directory {self.out_dir}: not a directory")


@dataclass
class BuildResult:
    """One graph's build: each stage True (passed), False (failed) or None (did not run)."""

    name: str
    variant: str = "fp32"
    status: BuildStatus = "failed"
    seconds: float = 0.0
    file: str | None = None
    sha256: str | None = None
    error: str | None = None
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(STAGES))
    #: The failure's traceback, its causes included, where the build was asked for them (``debug``).
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    @property
    def failed_stage(self) -> str | None:
        return next((k for k, v in self.stages.items() if v is False), None)


@dataclass
class BuildSummary:
    """All results of one build run."""

    out_dir: str
    results: list[BuildResult]
    seconds: float
    #: Whether the folder holds a manifest after the run (a run that built nothing into a
    #: new folder leaves none).
    manifest: bool = True

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.results), default=0)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": self.out_dir,
            "seconds": round(self.seconds, 3),
            "counts": self.counts,
            "exit_code": self.exit_code,
            "manifest": self.manifest,
            "results": [dataclasses.asdict(r) for r in self.results],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildSummary:
        return cls(d["out_dir"], [BuildResult(**r) for r in d["results"]], d["seconds"], d.get("manifest", True))
