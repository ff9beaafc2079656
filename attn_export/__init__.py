"""attn-export: PyTorch attention modules to ONNX, verified in ONNX Runtime.

Importing the package is cheap: torch and onnxruntime load only when a command needs them.
The Python API (``attn_export.api``) loads on first use:

    import attn_export

    summary = attn_export.build("models/mha.toml", out="build")    # BuildSummary
    report = attn_export.verify("build")                            # VerifyReport
    attn_export.export(module, inputs={"x": ["batch", "seq", 64]}, dims={"batch": (1, 8), "seq": (1, 128)})
    attn_export.assert_onnx_matches(module, "model.onnx", dims={"batch": (1, 8), "seq": (1, 128)})

``attn_export.build``, ``.verify`` and ``.export`` are those functions even once the
modules of the same names (``attn_export/build.py``, ...) are imported; import from the
modules by their full names.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "assert_onnx_matches", "build", "export", "verify"]

_API = ("assert_onnx_matches", "build", "export", "verify")


def __getattr__(name: str) -> Any:
    if name in _API:
        import attn_export.api

        globals()[name] = getattr(attn_export.api, name)
        return globals()[name]
    raise AttributeError(f"module 'attn_export' has no attribute '{name}'")


class _Package(types.ModuleType):
    """Keeps the API's names for its functions: importing a submodule of the same name
    would otherwise set the package attribute to the submodule."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
