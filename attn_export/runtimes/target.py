"""What verify runs a graph on: a runtime kind plus, for ONNX Runtime, an execution provider.

Providers are one table; a new provider is one row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_RUNTIME", "PROVIDERS", "Provider", "Target"]

DEFAULT_RUNTIME = "onnxruntime"


@dataclass(frozen=True)
class Provider:
    """An ONNX Runtime execution provider under our short name, and its PyTorch device."""

    name: str
    execution_provider: str
    torch_device: str
    install_hint: str = ""


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("cpu", "CPUExecutionProvider", "cpu"),
        Provider("cuda", "CUDAExecutionProvider", "cuda", "install onnxruntime-gpu: pip install 'attn-export[gpu]'"),
    )
}


@dataclass(frozen=True)
class Target:
    """One runtime kind (a key of ``runtimes.RUNTIMES``) on one provider; ``provider`` is
    None for runtimes that have none (the ONNX reference evaluator)."""

    runtime: str
    provider: str | None = None

    @property
    def label(self) -> str:
        """How reports name it: ``onnxruntime[cpu]``, ``onnx-reference``."""
        return self.runtime if self.provider is None else f"{self.runtime}[{self.provider}]"

    def cli_args(self) -> list[str]:
        """The ``attn-export verify`` arguments that select this target."""
        args = [] if self.runtime == DEFAULT_RUNTIME else ["--runtime", self.runtime]
        return args + ([] if self.provider is None else ["--provider", self.provider])

    def to_dict(self) -> dict[str, str | None]:
        return {"runtime": self.runtime, "provider": self.provider}

    @classmethod
    def of_result(cls, d: Mapping[str, Any], where: str) -> Target:
        """The ``target`` object of a result ``d`` read from a report (``to_dict``), each
        field checked; ArtifactError naming the first that is not."""
        from attn_export.artifacts.json_fields import json_field, json_record

        return json_record(cls, json_field(d, "target", dict, where), f"{where}.target")
