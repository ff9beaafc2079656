"""Terminal rendering of ``attn-export inspect``."""

from __future__ import annotations

from attn_export.pipelines.inspect import InspectResult, TensorInfo

__all__ = ["format_inspect"]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _tensor(t: TensorInfo) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in t.shape)
    return f"  {t.name:<16} {t.dtype:<8} [{dims}]"


def format_inspect(r: InspectResult) -> str:
    lines = [
        f"file:        {r.file} ({_mb(r.size_bytes)}, sha256 {r.sha256[:16]}...)",
        f"ir_version:  {r.ir_version}",
        f"producer:    {r.producer or '-'}",
        "opsets:      " + ", ".join(f"{k} {v}" for k, v in r.opsets.items()),
        "metadata:" + ("" if r.metadata else "    none"),
        *(f"  {k} = {v}" for k, v in r.metadata.items()),
        "inputs:",
        *(_tensor(t) for t in r.inputs),
        "outputs:",
        *(_tensor(t) for t in r.outputs),
        f"ops:         {r.nodes} nodes: " + ", ".join(f"{k} {v}" for k, v in r.ops.items()),
        f"parameters:  {r.parameters:,} ({_mb(r.parameter_bytes)}) in {r.initializers} initializers",
        "external:    " + (", ".join(r.external_data) if r.external_data else "none"),
        "checker:     " + (f"REJECTED: {r.checker_problem}" if r.checker_problem else "ok"),
        f"kernels:     {r.provider}: " + ("every op has a kernel" if r.kernels_ok else f"MISSING: {r.kernel_problem}"),
    ]
    return "\n".join(lines)
