"""Runtimes: PyTorch, ONNX Runtime (each provider) and the ONNX reference evaluator, one interface.

Each answers ``run(feeds) -> dict[str, np.ndarray]`` with the same input checks; a new
runtime is one new module with a ``Runtime`` subclass.
"""

from __future__ import annotations

from attn_export.runtimes.base import Runtime, check_feeds

__all__ = ["Runtime", "check_feeds"]
