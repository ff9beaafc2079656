"""One error hierarchy: the CLI turns each class into a one-line message and an exit code.

Exit codes across the CLI: 0 success, 1 a check failed (``CheckFailed``), 2 bad usage or
bad input (``UsageError``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence

__all__ = [
    "ArtifactError",
    "AttnExportError",
    "CheckFailed",
    "ExportFailure",
    "GraphCheckError",
    "InputError",
    "LockError",
    "MissingDependencyError",
    "NotLocalizable",
    "Notice",
    "OptionError",
    "ProviderError",
    "RunTimeout",
    "RuntimeFailure",
    "SpecError",
    "UsageError",
    "first_line",
    "notify",
    "one_line",
]


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's whole message on one line, cut at ``limit`` characters: for a message
    whose first line stops mid-sentence (onnx.checker's names the node on the next)."""
    text = " ".join(str(exc).split())
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


class AttnExportError(Exception):
    """Raised on purpose by attn-export; the CLI maps it to one line and ``exit_code``."""

    exit_code = 1


class CheckFailed(AttnExportError):
    """Raised when a model fails a check: export, graph structure, runtime (exit 1)."""

    exit_code = 1


class UsageError(AttnExportError):
    """Raised when the caller's arguments or files are invalid (exit 2)."""

    exit_code = 2


class NotLocalizable(UsageError):
    """Raised when a graph or a case cannot be localized: its nodes do not name the FX node
    and source line they came from, or its inputs are not ones the module can be fed."""


#: A field of an ``OptionError`` template: ``{option}``, ``{value}`` or ``{value!r}``.
_FIELD = re.compile(r"\{(\w+)(!r)?\}")


class OptionError(UsageError):
    """Raised when an option's value, or two options together, are refused. The message
    names each option as the library's parameter (``regions``); a face that calls it
    otherwise (the CLI's ``--strict-regions``) says the message with ``named``."""

    def __init__(self, template: str, options: Sequence[str], **values: object) -> None:
        """``template`` holds ``{option}`` where each of ``options`` is named, and the
        ``values`` it shows."""
        self.template, self.options, self.values = template, tuple(options), values
        super().__init__(self.named({}))

    def named(self, names: Mapping[str, str]) -> str:
        """The message with each option called as ``names`` calls it (else by its parameter).
        Only the template's own fields are filled: text it quotes (a model's name, a path)
        keeps its braces, where ``str.format`` would read them as fields and fail."""
        fields = {**self.values, **{o: names.get(o, o) for o in self.options}}

        def filled(match: re.Match[str]) -> str:
            name, conversion = match.group(1), match.group(2)
            if name not in fields:
                return match.group(0)
            return repr(fields[name]) if conversion else str(fields[name])

        return _FIELD.sub(filled, self.template)

    def called(self, names: Mapping[str, str]) -> OptionError:
        """This error as a face whose parameters are not the options' own names says it (the
        API's ``spec`` for ``spec_file``): still an OptionError, that ``named`` words alike."""
        error = OptionError(self.template, self.options, **self.values)
        error.args = (self.named(names),)
        return error


class Notice(UserWarning):
    """Issued by the Python API and the pytest plugin for what the CLI says beside its
    verdict (a note on a model that passes, a model a check could not take): the verdict
    stands, and the note reaches a script or a test run that shows no stderr."""


def notify(text: str) -> None:
    """``text`` as a ``Notice``: what the faces without a terminal of their own (the Python
    API, the pytest plugin) pass where the CLI passes its notice on stderr."""
    warnings.warn(text, Notice, stacklevel=2)


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


class ExportFailure(CheckFailed):
    """Raised when torch cannot export a module to ONNX."""


class GraphCheckError(CheckFailed):
    """Raised when an exported graph fails a structural check (checker, dynamic axes)."""


class NondeterministicModule(CheckFailed):
    """Raised when the PyTorch module is random in eval mode (its FX program draws random
    numbers, or two runs on one input differ): it cannot be the reference, and its
    randomness must never become tolerance."""


class RuntimeFailure(CheckFailed):
    """Raised when a runtime cannot load a graph, uses the wrong provider, or fails to run."""


class RunTimeout(RuntimeFailure):
    """Raised when a run of a graph or a region goes past its time limit and is stopped
    (a Loop without end in a graph from elsewhere)."""
