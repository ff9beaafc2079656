"""Lazy imports of optional heavy dependencies, with a one-line install hint when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from attn_export.errors import MissingDependencyError

_HINTS = {
    "torch": "pip install 'attn-export[export]'",
    "onnxscript": "pip install 'attn-export[export]'",
    "matplotlib": "pip install 'attn-export[plot]'",
    "transformers": "pip install 'attn-export[hf]'",
    "ray": "pip install 'attn-export[ray]'",
    "onnxruntime_genai": "pip install 'attn-export[genai]'",
}


#: Optional packages a spec's module or config may come from.
OPTIONAL = frozenset(_HINTS)


def missing(module: str, purpose: str) -> MissingDependencyError:
    """The error for an uninstalled ``module``, saying what to install."""
    hint = _HINTS.get(module.split(".")[0], f"pip install {module}")
    return MissingDependencyError(f"{purpose} needs {module}, which is not installed ({hint})")


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing(module, purpose) from e
