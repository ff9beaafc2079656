"""One error hierarchy: the CLI turns each class into a one-line message and an exit code.

Exit codes across the CLI: 0 success, 1 a check failed, 2 bad usage or bad input.
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "AttnExportError",
    "ExportFailure",
    "GraphCheckError",
    "InputError",
    "LockError",
    "MissingDependencyError",
    "ProviderError",
    "RuntimeFailure",
    "SpecError",
    "UsageError",
]


class AttnExportError(Exception):
    """Raised when a command's checks fail; the base of every error raised on purpose."""

    exit_code = 1


class UsageError(AttnExportError):
    """Raised when the caller's arguments or files are invalid (exit 2)."""

    exit_code = 2


class SpecError(UsageError):
    """Raised when a model spec cannot be read or does not describe a buildable model."""


class ArtifactError(UsageError):
    """Raised when an artifact, golden file or manifest is missing, unreadable or malformed."""


class InputError(UsageError):
    """Raised when feeds or requested shapes do not fit a model's declared inputs."""


class ProviderError(UsageError):
    """Raised when a requested ONNX Runtime execution provider is not installed."""


class MissingDependencyError(UsageError):
    """Raised when a command needs an optional dependency that is not installed."""


class LockError(UsageError):
    """Raised when another build holds the output directory."""


class ExportFailure(AttnExportError):
    """Raised when torch cannot export a module to ONNX."""


class GraphCheckError(AttnExportError):
    """Raised when an exported graph fails a structural check (checker, dynamic axes)."""


class RuntimeFailure(AttnExportError):
    """Raised when a runtime cannot load a graph, uses the wrong provider, or fails to run."""
