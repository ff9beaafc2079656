"""Latency against sequence length (bench) or past length (bench --decode), one line per
runner; matplotlib is optional."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export._deps import require
from attn_export.artifacts.files import write_output
from attn_export.pipelines.bench.results import BenchReport, DecodeBenchReport
from attn_export.report.base import BenchFormat

__all__ = ["BENCH_FORMAT", "plot_decode_latency", "plot_latency", "plot_report"]


@dataclass(frozen=True)
class Panel:
    """A figure of each row drawn beside the latency, a line per runner against the same x:
    its axis label, its value on a row (None: not drawn), and a level drawn across the panel
    (the run's copy bandwidth), None for none."""

    label: str
    value: Callable[[Any], float | None]
    level: tuple[str, float] | None = None


def _plot(
    report: BenchReport | DecodeBenchReport,
    path: Path,
    x: str,
    style: Callable[[Any, str, int], None],
    floor: Callable[[Any], float | None] | None = None,
    beside: Sequence[Panel] = (),
) -> None:
    """One row of panels per model x batch, a line per runner: p50 latency against ``x`` of
    each row, and, where ``floor`` gives one, the row's floor dashed in the runner's colour;
    ``style`` sets the latency panel's axes and title from its model and batch. Each of
    ``beside`` is a panel to its right, the runners in the same colours."""
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[Any] = list(report.rows)
    panels = sorted({(r.model, r.batch) for r in rows})
    columns = 1 + len(beside)
    fig, axes = plt.subplots(len(panels), columns, figsize=(8 + 5.5 * len(beside), 4.5 * len(panels)), squeeze=False)
    for row_axes, (model, batch) in zip(axes, panels, strict=True):
        ax = row_axes[0]
        mine = [r for r in rows if (r.model, r.batch) == (model, batch)]
        colour = {}
        for runner in dict.fromkeys(r.runner for r in mine):
            points = sorted((getattr(r, x), r.latency.p50_ms) for r in mine if r.runner == runner)
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=runner)
            colour[runner] = line.get_color()
            floors = sorted((getattr(r, x), floor(r)) for r in mine if r.runner == runner and floor and floor(r))
            if floors:
                label = f"{runner} bandwidth limit"
                # marked: a single past length is one point, which a dashed line alone does not draw
                xs, ys = [p[0] for p in floors], [p[1] for p in floors]
                ax.plot(xs, ys, "--", marker="x", color=line.get_color(), label=label)
        style(ax, model, batch)
        ax.legend()
        for side, panel in zip(row_axes[1:], beside, strict=True):
            _beside(side, panel, mine, x, colour)
            side.set_xlabel(ax.get_xlabel())
            side.set_title(f"{model}, batch {batch}")
    _finish(fig, report, path)


def _beside(ax: Any, panel: Panel, rows: list[Any], x: str, colour: dict[str, str]) -> None:
    for runner, col in colour.items():
        points = sorted((getattr(r, x), panel.value(r)) for r in rows if r.runner == runner and panel.value(r))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=col, label=runner)
    if panel.level is not None:
        ax.axhline(panel.level[1], color="black", linestyle="--", label=panel.level[0])
    ax.set_ylim(bottom=0)
    ax.set_ylabel(panel.label)
    ax.grid(True, alpha=0.3)
    ax.legend()


def plot_latency(report: BenchReport, path: Path) -> None:
    """Latency against sequence length, log-log, titled with the machine and versions."""

    def style(ax: Any, model: str, batch: int) -> None:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("p50 latency (ms)")
        ax.set_title(f"{model}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)

    _plot(report, path, "seq", style)


def plot_decode_latency(report: DecodeBenchReport, path: Path) -> None:
    """Per-token latency against the past length, linear axes (past 0 is a point, and a
    step's cost grows about linearly with the cache), each runner's bandwidth limit dashed
    (the bytes its step moves at the run's copy bandwidth); beside it the bytes each step
    moves per token and the bandwidth it achieves, the run's copy bandwidth across it."""

    def style(ax: Any, model: str, batch: int) -> None:
        ax.set_ylim(bottom=0)
        ax.set_xlabel("past length (cached tokens)")
        ax.set_ylabel("p50 ms per step")
        seqs = sorted({r.seq for r in report.rows if (r.model, r.batch) == (model, batch)})
        step = "one decode step" if seqs == [1] else f"a step of {'/'.join(map(str, seqs))} tokens"
        ax.set_title(f"{model}, batch {batch}, {step}")
        ax.grid(True, alpha=0.3)

    def limit_ms(row: Any) -> float | None:
        return row.latency.p50_ms / row.limit_ratio if row.limit_ratio else None

    copy = report.copy_gbps
    beside = (
        Panel("MB moved per token", lambda r: r.bytes_per_token / 1e6 if r.bytes_per_token else None),
        Panel("achieved GB/s", lambda r: r.gbps, (f"copy bandwidth {copy:.1f} GB/s", copy) if copy else None),
    )
    _plot(report, path, "past", style, limit_ms, beside)


def _finish(fig: Any, report: BenchReport | DecodeBenchReport, path: Path) -> None:
    """Title with the machine and versions, then write the image atomically, in the format
    its suffix names (``BENCH_FORMAT.suffixes``)."""
    import matplotlib.pyplot as plt

    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items())
    fig.suptitle(f"{report.machine}, {report.threads} threads, {report.provider}\n{versions}", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lower().lstrip(".") or "png", dpi=110)
    plt.close(fig)
    write_output(path, buf.getvalue())


def plot_report(report: BenchReport | DecodeBenchReport, path: Path) -> None:
    """Latency against sequence length (bench) or past length (``--decode``)."""
    if isinstance(report, DecodeBenchReport):
        plot_decode_latency(report, path)
    else:
        plot_latency(report, path)


BENCH_FORMAT = BenchFormat(
    "plot",
    plot_report,
    "Draw latency against sequence length (past length with --decode) to this .png, .svg or .pdf (needs matplotlib).",
    requires="matplotlib",
    suffixes=(".png", ".svg", ".pdf"),
)
