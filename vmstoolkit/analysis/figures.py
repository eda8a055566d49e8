"""Figures of the fragmentation experiment.

Built on ``matplotlib.figure.Figure`` directly (no pyplot): no display is needed and importing
this module never changes the backend of the caller (a notebook keeps its inline figures).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from vmstoolkit.units import GiB

_MAX_POINTS = 4000  # timelines are thinned to this many points: the figure looks the same, 10x smaller PNG


def utilization_figure(rows: list[dict], allocators: list[str], path: Path) -> Path:
    """Grouped bars: utilization (peak allocated / peak reserved) per workload and allocator.
    Synthetic workloads are labelled as such."""
    workloads = [r["workload"] + (" (synthetic)" if r.get("synthetic") else "") for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / max(1, len(allocators))
    fig = Figure(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.2))
    ax = fig.subplots()
    for i, a in enumerate(allocators):
        vals = [r.get(f"{a}.utilization") or 0.0 for r in rows]
        bars = ax.bar(x + (i - (len(allocators) - 1) / 2) * width, vals, width, label=a)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x, workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("utilization (peak allocated / peak reserved)")
    ax.set_ylim(0, 1.0)  # a ratio capped at 1; the legend sits outside the axes, labels may pass the top
    for t in ax.texts:
        t.set_clip_on(False)
    ax.set_title("Memory utilization per workload and allocator", pad=14)
    ax.legend(fontsize=7, ncol=min(4, len(allocators)), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return path


def _thin(n: int) -> np.ndarray:
    if n <= _MAX_POINTS:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, _MAX_POINTS).astype(np.int64))


def timeline_figure(timelines: dict[str, dict[str, dict]], path: Path, *, synthetic: set[str] | frozenset = frozenset()) -> Path:
    """Reserved memory of each allocator and allocated memory over time, one panel per workload.

    ``timelines`` maps workload to ``{allocator: replay timeline}`` (``allocated``, ``reserved``,
    ``time_us`` arrays, one entry per event). The x axis is seconds since the trace's first event
    (the recorded clock, as the notebooks draw it); a synthetic workload (in ``synthetic``) has no
    clock, so its panel counts events instead.
    """
    n = len(timelines)
    fig = Figure(figsize=(8, 2.6 * n + 0.8))
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, (workload, by_alloc) in zip(axes, timelines.items()):
        clock = workload not in synthetic
        allocated_drawn = False
        for name, tl in by_alloc.items():
            reserved = np.asarray(tl["reserved"])
            idx = _thin(len(reserved))
            t = np.asarray(tl["time_us"], dtype=np.float64)
            x = (t[idx] - t[0]) / 1e6 if clock and len(t) else idx
            ax.plot(x, reserved[idx] / GiB, label=f"{name} reserved", linewidth=1.1)
            if not allocated_drawn:
                allocated = np.asarray(tl["allocated"])
                ax.fill_between(x, allocated[idx] / GiB, color="0.75", label="allocated", step="post")
                allocated_drawn = True
        ax.set_xlabel("seconds since the first recorded event" if clock else "event (alloc or free)")
        ax.set_ylabel("GiB")
        ax.set_title(f"{workload}" + ("" if clock else " (SYNTHETIC workload)"), fontsize=9)
        ax.legend(fontsize=6, loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle("Reserved vs allocated memory")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return path
