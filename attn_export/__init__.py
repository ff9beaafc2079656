"""attn-export: PyTorch attention modules to ONNX, verified in ONNX Runtime.

Importing the package is cheap: torch and onnxruntime load only when a command needs them.
The Python API (``attn_export.api``) loads on first use:

    import attn_export

    summary = attn_export.build("models/mha.toml", out="build")    # BuildSummary
    report = attn_export.verify("build")                            # VerifyReport
    attn_export.export(module, inputs={"x": ["batch", "seq", 64]}, dims={"batch": (1, 8), "seq": (1, 128)})
    attn_export.assert_onnx_matches(module, "model.onnx", dims={"batch": (1, 8), "seq": (1, 128)})
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

__all__ = ["__version__", "assert_onnx_matches", "build", "export", "verify"]

_API = ("assert_onnx_matches", "build", "export", "verify")


def __getattr__(name: str) -> Any:
    if name in _API:
        import attn_export.api

        globals()[name] = getattr(attn_export.api, name)
        return globals()[name]
    raise AttributeError(f"module 'attn_export' has no attribute '{name}'")
