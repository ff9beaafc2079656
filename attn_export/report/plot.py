"""Latency against sequence length (bench) or past length (bench --decode), one line per
runner; matplotlib is optional."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from attn_export._deps import require
from attn_export.artifacts.files import atomic_write
from attn_export.bench.decode import DecodeBenchReport
from attn_export.bench.run import BenchReport

__all__ = ["plot_decode_latency", "plot_latency"]


def plot_latency(report: BenchReport, path: Path) -> None:
    """One panel per model x batch, log-log axes, titled with the machine and versions."""
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.model, r.batch) for r in report.rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4.5 * len(panels)), squeeze=False)
    for ax, (model, batch) in zip(axes[:, 0], panels, strict=True):
        rows = [r for r in report.rows if (r.model, r.batch) == (model, batch)]
        for runner in dict.fromkeys(r.runner for r in rows):
            points = sorted((r.seq, r.latency.p50_ms) for r in rows if r.runner == runner)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=runner)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("p50 latency (ms)")
        ax.set_title(f"{model}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    _finish(fig, report, path)


def plot_decode_latency(report: DecodeBenchReport, path: Path) -> None:
    """Per-token latency against the past length, one panel per model x batch, linear
    axes (past 0 is a point, and a step's cost grows about linearly with the cache)."""
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.model, r.batch) for r in report.rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4.5 * len(panels)), squeeze=False)
    for ax, (model, batch) in zip(axes[:, 0], panels, strict=True):
        rows = [r for r in report.rows if (r.model, r.batch) == (model, batch)]
        for runner in dict.fromkeys(r.runner for r in rows):
            points = sorted((r.past, r.latency.p50_ms) for r in rows if r.runner == runner)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=runner)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("past length (cached tokens)")
        ax.set_ylabel("p50 ms per token")
        ax.set_title(f"{model}, batch {batch}, one decode step")
        ax.grid(True, alpha=0.3)
        ax.legend()
    _finish(fig, report, path)


def _finish(fig: Any, report: BenchReport | DecodeBenchReport, path: Path) -> None:
    """Title with the machine and versions, then write the PNG atomically."""
    import matplotlib.pyplot as plt

    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items())
    fig.suptitle(f"{report.machine}, {report.threads} threads, {report.provider}\n{versions}", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
