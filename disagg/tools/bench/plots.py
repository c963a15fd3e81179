"""PNG plots of benchmark results (matplotlib, Agg backend).

- :func:`plot_pareto`: total tok/s/GPU against P90 interactivity for one or
  more sweeps: every run as a point (labelled by its run), each sweep's
  Pareto front as a monotone (Steffen) curve, and the front's values at the
  target interactivities (dashed verticals).
- :func:`plot_latency_cdfs`: TTFT and per-request ITL CDFs, one line per run.
- :func:`plot_compare`: an A/B plot, two fronts plus a table of B/A ratios
  at the targets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from disagg.tools.bench.pareto import (  # noqa: E402
    DEFAULT_TARGETS,
    compare_fronts,
    front_at,
    monotone_interpolate,
    pareto_front,
)

Series = tuple[str, Sequence[tuple[float, float]], Sequence[str]]  # name, points, point labels


def _draw_fronts(ax: plt.Axes, series: Sequence[Series], targets: Sequence[float]) -> None:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, points, labels) in enumerate(series):
        color = colors[k % len(colors)]
        if not points:
            continue
        xs, ys = zip(*points, strict=False)
        ax.scatter(xs, ys, color=color, alpha=0.5, s=18)
        for (x, y), label in zip(points, labels, strict=False):
            ax.annotate(
                label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color
            )
        idx = pareto_front(points)
        fx = [points[i][0] for i in idx]
        fy = [points[i][1] for i in idx]
        if len(fx) > 1:
            grid = np.linspace(fx[0], fx[-1], 200)
            ax.plot(grid, [monotone_interpolate(fx, fy, g) for g in grid], color=color, label=name)
        else:
            ax.plot(fx, fy, "o", color=color, label=name)
        for t, y in front_at(points, targets).items():
            if y is not None:
                ax.plot([t], [y], "D", color=color, ms=6)
    for t in targets:
        ax.axvline(t, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("P90 interactivity (tokens/s/user)")
    ax.set_ylabel("total tokens/s/GPU")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def plot_pareto(
    series: Sequence[Series],
    path: str | Path,
    targets: Sequence[float] = DEFAULT_TARGETS,
    title: str = "",
) -> Path:
    """Throughput/GPU vs P90 interactivity with Pareto fronts; returns the PNG path."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    _draw_fronts(ax, series, targets)
    ax.set_title(title or "throughput vs interactivity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _cdf(ax: plt.Axes, values: Sequence[float], label: str) -> None:
    if len(values) == 0:
        return
    v = np.sort(np.asarray(values, dtype=float))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def plot_latency_cdfs(
    runs: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | Path, title: str = ""
) -> Path:
    """TTFT and ITL CDFs; ``runs`` maps a label to (TTFT ms, ITL ms)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, (ttft, itl) in runs.items():
        _cdf(a1, ttft, label)
        _cdf(a2, itl, label)
    for ax, name in ((a1, "TTFT (ms)"), (a2, "ITL per request (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.axhline(0.9, color="grey", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=7)
    fig.suptitle(title or "latency distributions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_compare(
    a: Series, b: Series, path: str | Path, targets: Sequence[float] = DEFAULT_TARGETS
) -> tuple[Path, list[dict]]:
    """Two fronts on one plot and a table of B/A at the targets; returns (path, rows)."""
    rows = compare_fronts(a[1], b[1], targets)
    fig, (ax, tab) = plt.subplots(2, 1, figsize=(7.5, 6.5), gridspec_kw={"height_ratios": [4, 1]})
    _draw_fronts(ax, [a, b], targets)
    ax.set_title(f"{b[0]} vs {a[0]}")

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    cells = [
        [
            fmt(r["target"], ".0f"),
            fmt(r["a"], ",.0f"),
            fmt(r["b"], ",.0f"),
            fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else ""),
        ]
        for r in rows
    ]
    tab.axis("off")
    table = tab.table(
        cellText=cells,
        colLabels=["tok/s/user", a[0], b[0], "ratio B/A"],
        loc="center",
        cellLoc="center",
    )
    table.scale(1, 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path), rows
