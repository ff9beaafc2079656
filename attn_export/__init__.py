"""attn-export: PyTorch attention modules to ONNX, verified in ONNX Runtime.

Importing the package is cheap: torch and onnxruntime load only when a command needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
