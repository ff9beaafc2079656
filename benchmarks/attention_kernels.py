"""The kernels under a prefill: ONNX Runtime's attention and projection kernels against
PyTorch's, on the same inputs, with the floor each side's kernels set.

    python benchmarks/attention_kernels.py              # about a minute on 2 cores
    python benchmarks/attention_kernels.py --threads 1

The shapes of ``benchmarks/perf_table.py``'s model (hidden 512, 8 heads of 64, batch 1) at
seq 128, 512 and 2048, no graph around them:

* attention alone, on the same Q, K and V: ONNX Runtime's ``com.microsoft.MultiHeadAttention``
  (the op ``ort-fused`` leaves, taking its biases as ort-fused's does), the ONNX
  ``Attention`` op (opset 23) and PyTorch's ``F.scaled_dot_product_attention``, which is
  what ``torch.compile`` turns the seed's softmax into;
* one projection, ``x @ W + b`` at [seq, 512] x [512, 512]: ONNX Runtime's MatMul and Add
  against PyTorch's ``F.linear``; the module has four;
* and, for scale, the whole seed module through ``torch.compile(module, dynamic=True)``,
  compiled before it is timed.

Every kernel takes turns with the others in alternating blocks
(``runtimes.timing.measure_alternating``), with the same threads on every side and ONNX
Runtime's idle threads not spinning; ``--repeats`` rounds of that. The floor of a side is
its faster attention kernel plus four of its projections: what a graph of that side's
kernels costs with nothing else in it. Where ONNX Runtime's floor is above the compiled
module's whole call, no rewrite of the graph brings it level with ``torch.compile``.
Nothing here asserts: figures are printed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from repeats import (  # benchmarks/repeats.py, next to this script
    heading,
    repeated,
    spread,
    started,
    timing_arguments,
)

HIDDEN, HEADS = 512, 8
SIZES = (128, 512, 2048)
ORT_ATTENTION = ("ort:MultiHeadAttention", "ort:Attention")
TORCH_ATTENTION = "torch:sdpa"
COMPILED = "torch-compile: the whole module"
ORT_PROJECTION, TORCH_PROJECTION = "ort:MatMul+Add", "torch:linear"


def _graphs() -> dict[str, bytes]:
    """The three one-op graphs, over any seq."""
    from onnx import TensorProto, helper, numpy_helper

    def model(nodes: list[Any], inputs: list[str], inits: list[Any], opset: int) -> bytes:
        graph = helper.make_graph(
            nodes,
            "kernel",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "seq", HIDDEN]) for n in inputs],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            inits,
        )
        imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
        return bytes(helper.make_model(graph, opset_imports=imports).SerializeToString())

    zeros = np.zeros(3 * HIDDEN, dtype=np.float32)
    weight = np.random.default_rng(1).standard_normal((HIDDEN, HIDDEN), dtype=np.float32) / HIDDEN**0.5
    return {
        ORT_ATTENTION[0]: model(
            [
                helper.make_node(
                    "MultiHeadAttention", ["q", "k", "v", "b"], ["y"], domain="com.microsoft", num_heads=HEADS
                )
            ],
            ["q", "k", "v"],
            [numpy_helper.from_array(zeros, "b")],
            18,
        ),
        ORT_ATTENTION[1]: model(
            [helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=HEADS, kv_num_heads=HEADS)],
            ["q", "k", "v"],
            [],
            23,
        ),
        ORT_PROJECTION: model(
            [helper.make_node("MatMul", ["q", "w"], ["xw"]), helper.make_node("Add", ["xw", "c"], ["y"])],
            ["q"],
            [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(zeros[:HIDDEN], "c")],
            18,
        ),
    }


def kernels(seq: int, threads: int, compiled: Any) -> dict[str, Callable[[], object]]:
    """Each kernel, and the ``compiled`` module, as a call on inputs already in place; the
    kernels checked to agree first, the module compiled for the shape."""
    import torch
    import torch.nn.functional as F

    from attn_export.runtimes.ort import load_session

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, seq, HIDDEN), dtype=np.float32) for _ in range(3))
    sessions = {label: load_session(g, threads=threads, spinning=False) for label, g in _graphs().items()}
    heads = [torch.from_numpy(a).view(1, seq, HEADS, -1).transpose(1, 2).contiguous() for a in (q, k, v)]
    w = torch.from_numpy(np.random.default_rng(1).standard_normal((HIDDEN, HIDDEN), dtype=np.float32) / HIDDEN**0.5)
    w_t, bias, x = w.t().contiguous(), torch.zeros(HIDDEN), torch.from_numpy(q)

    def attention() -> torch.Tensor:
        with torch.inference_mode():
            return F.scaled_dot_product_attention(*heads)

    def projection() -> torch.Tensor:
        with torch.inference_mode():
            return F.linear(x, w_t, bias)

    def whole() -> torch.Tensor:
        with torch.inference_mode():
            return compiled(x, x, x)

    def run(label: str) -> Callable[[], Any]:
        session = sessions[label]
        feeds = {i.name: {"q": q, "k": k, "v": v}[i.name] for i in session.get_inputs()}
        return lambda: session.run(None, feeds)[0]

    calls: dict[str, Callable[[], Any]] = {label: run(label) for label in sessions}
    calls[TORCH_ATTENTION], calls[TORCH_PROJECTION], calls[COMPILED] = attention, projection, whole
    for _ in range(3):  # Dynamo compiles on the first calls of a new shape, not timed
        whole()
    expected = attention().transpose(1, 2).reshape(1, seq, HIDDEN).numpy()
    for label in ORT_ATTENTION:
        np.testing.assert_allclose(calls[label](), expected, atol=1e-5, err_msg=label)
    np.testing.assert_allclose(calls[ORT_PROJECTION](), projection().numpy(), atol=1e-4, err_msg=ORT_PROJECTION)
    return calls


def floors(p50s: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    """Per repeat, ONNX Runtime's floor and PyTorch's (ms)."""
    ort = [
        min(a, b) + 4 * p
        for a, b, p in zip(*(p50s[label] for label in ORT_ATTENTION), p50s[ORT_PROJECTION], strict=True)
    ]
    torch_ = [a + 4 * p for a, p in zip(p50s[TORCH_ATTENTION], p50s[TORCH_PROJECTION], strict=True)]
    return ort, torch_


def table(by_seq: dict[int, dict[str, list[float]]]) -> str:
    """Markdown: a row per kernel and per floor, per seq its p50 and its ratio to PyTorch's
    kernel of the same job, each median [lowest–highest] over the repeats."""
    head = " | ".join(f"seq {s} p50 (ms) | vs PyTorch" for s in by_seq)
    lines = [f"| kernel | {head} |", "|---|" + "---:|---:|" * len(by_seq)]
    rows: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for seq, p50s in by_seq.items():
        for label in (*ORT_ATTENTION, TORCH_ATTENTION):
            rows.setdefault(label, {})[seq] = (p50s[label], p50s[TORCH_ATTENTION])
        for label in (ORT_PROJECTION, TORCH_PROJECTION):
            rows.setdefault(label, {})[seq] = (p50s[label], p50s[TORCH_PROJECTION])
        ort, torch_ = floors(p50s)
        rows.setdefault("floor: ONNX Runtime", {})[seq] = (ort, torch_)
        rows.setdefault("floor: PyTorch", {})[seq] = (torch_, torch_)
        rows.setdefault(COMPILED, {})[seq] = (p50s[COMPILED], torch_)
    for label, cells in rows.items():
        row = []
        for mine, theirs in cells.values():
            row += [spread(mine, ".3f"), spread([m / t for m, t in zip(mine, theirs, strict=True)], ".2f", "x")]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _verdict(mine: list[float], theirs: list[float]) -> str:
    ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
    where = "above" if min(ratios) > 1 else "below" if max(ratios) < 1 else "level (the repeats' spread holds 1.00)"
    return f"{spread(ratios, '.2f', 'x')}, {where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    timing_arguments(
        parser,
        repeats="rounds of alternating blocks per seq",
        budget="seconds of timed calls per kernel, seq and repeat",
        threads="threads on every side (default: the physical cores)",
    )
    args = parser.parse_args()
    command, threads = started(parser, args, "attention_kernels.py")

    import torch

    from attn_export.artifacts.provenance import versions
    from attn_export.pipelines.bench.runners import timing_machine
    from attn_export.runtimes.timing import load_average
    from attn_export.zoo.seed import MultiHeadAttention

    load_start = load_average()
    compiled = torch.compile(MultiHeadAttention(HIDDEN, HEADS).eval(), dynamic=True)
    by_seq = {seq: repeated(kernels(seq, threads, compiled), args.repeats, args.budget) for seq in SIZES}
    load_end = load_average()
    print(heading(command, timing_machine(), versions()))
    print(
        f"load average {load_start:.2f} at the start, {load_end:.2f} at the end; batch 1, hidden {HIDDEN}, "
        f"{HEADS} heads, {threads} thread{'s' if threads != 1 else ''} on every side; {args.repeats} repeats "
        f"of alternating blocks, {args.budget:g} s per kernel, seq and repeat\n"
    )
    print(table(by_seq))
    print()
    for seq, p50s in by_seq.items():
        ort, torch_ = floors(p50s)
        for what, theirs in (("PyTorch's floor", torch_), ("torch.compile's whole call", p50s[COMPILED])):
            print(f"seq {seq}: ONNX Runtime's floor against {what}: {_verdict(ort, theirs)}")


if __name__ == "__main__":
    main()
