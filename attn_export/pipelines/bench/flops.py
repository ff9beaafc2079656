"""FLOPs of one forward pass and this machine's float32 matmul peak, both measured here."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.runtimes.ort import load_session

__all__ = ["count_flops", "matmul_peak_gflops"]


def count_flops(module: Any, feeds: Mapping[str, np.ndarray]) -> int:
    """FLOPs of the projections and attention matmuls, counted by torch's FlopCounterMode.

    Scaled-dot-product attention runs on its math backend while counting, so its two
    matmuls are counted like the seed's explicit ones.
    """
    torch = require("torch", "counting FLOPs")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    args = [torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()]
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        module(*args)
    return int(counter.get_total_flops())


def _best_seconds(call: Any, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_gflops(threads: int, n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a large float32 GEMM in PyTorch and in ONNX Runtime with ``threads``
    threads; the larger is this machine's peak for the report's efficiency column."""
    from onnx import TensorProto, helper

    torch = require("torch", "measuring the matmul peak")
    flops = 2.0 * n**3
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        torch_gflops = flops / _best_seconds(lambda: torch.mm(a, b), repeats) / 1e9
    finally:
        torch.set_num_threads(saved)

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in ("a", "b")],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    session = load_session(model.SerializeToString(), "cpu", threads=threads)
    feeds = {"a": a.numpy(), "b": b.numpy()}
    ort_gflops = flops / _best_seconds(lambda: session.run(None, feeds), repeats) / 1e9
    return {"torch": torch_gflops, "onnxruntime": ort_gflops, "peak": max(torch_gflops, ort_gflops)}
