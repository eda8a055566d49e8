"""The ``vmstoolkit view`` report: one self-contained, offline HTML page (plotly, its JavaScript
inlined) with, per allocator, memory over time on the trace's clock (hover: the event's size,
stream and Python frame) and the segment/stitch layout at its peak reserved.

Pure data -> figure code; replays happen in :func:`view_data`. plotly is the ``[view]`` extra.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from vmstoolkit.errors import VmsError
from vmstoolkit.units import GiB, MiB

MAX_POINTS = 3000
"""Points per line: buckets of events keep their highest value, so peaks survive; 3000 points
per allocator keep a page of four allocators under ~5 MB beside plotly's 4.6 MB of JavaScript."""
MAX_SEGMENT_ROWS = 48
"""Segments drawn in each layout figure by default, the largest first; the figure's title says
how many were left out and their bytes (``vmstoolkit view --segments all`` draws every one)."""


class ViewError(VmsError):
    """The report cannot be made (plotly missing, nothing to draw)."""


@dataclass
class AllocatorView:
    name: str
    options: str
    timeline: dict  # allocated, reserved, time_us per replayed event
    peak_reserved: int
    peak_index: int
    layout: list[dict] = field(default_factory=list)  # segment rows at the peak: see peak_layout
    oom_event: int | None = None
    segments: int = 0  # segments live at the peak, drawn or not
    hidden_bytes: int = 0  # bytes of the segments not drawn (beyond the row limit)

    @property
    def hidden(self) -> int:
        return self.segments - len(self.layout)


def _plotly():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ViewError("vmstoolkit view needs plotly: pip install 'vmstoolkit[view]'") from None
    return go


def thin_peaks(values: np.ndarray, n: int = MAX_POINTS) -> np.ndarray:
    """Indices of at most about ``n`` points of ``values`` keeping each bucket's maximum (and the
    first and last point). Cost: O(len(values))."""
    m = len(values)
    if m <= n:
        return np.arange(m)
    edges = np.linspace(0, m, n + 1).astype(np.int64)
    picks = [int(a + np.argmax(values[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    return np.unique(np.array([0, *picks, m - 1]))


def _runs(items: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Adjacent (start, size, kind) ranges of one kind merged into one."""
    out: list[list] = []
    for start, size, kind in sorted(items):
        if out and out[-1][2] == kind and out[-1][0] + out[-1][1] == start:
            out[-1][1] += size
        else:
            out.append([start, size, kind])
    return [tuple(r) for r in out]


def live_segments(driver) -> dict[int, int]:
    """base -> size of every segment now: each reserved range and each plain allocation."""
    return {**driver.live_reservations(), **driver.live_allocs()}


def peak_layout(driver, allocator, limit: int | None = MAX_SEGMENT_ROWS) -> list[dict]:
    """Segments at this moment, the ``limit`` largest (None: all): each reserved range (or plain
    allocation) with its mapped chunks (``stitched`` where a chunk is mapped in more than one
    range), and the live blocks in it."""
    segments = live_segments(driver)
    maps = driver.live_mappings()
    live = allocator.live_allocations()
    rows = []
    for base, size in sorted(segments.items(), key=lambda kv: -kv[1])[:limit]:
        end = base + size
        kinds = [(va - base, s, "stitched" if driver.aliases(h) > 1 else "mapped")
                 for va, (s, h) in maps.items() if base <= va < end]
        if not kinds and base in driver.live_allocs():
            kinds = [(0, size, "mapped")]
        blocks = [(a - base, s, "live") for a, s in live.items() if base <= a < end]
        rows.append({"base": base, "size": size, "chunks": _runs(kinds), "live": _runs(blocks)})
    return rows


def view_data(path: str | Path, allocators: list[str], options: dict[str, dict], capacity: int | None = None,
              max_segments: int | None = MAX_SEGMENT_ROWS, on_step: Callable[[str], None] | None = None) -> tuple:
    """Replay ``path`` through each allocator twice (whole, with a timeline; then up to its peak
    reserved, to read the layout there, the ``max_segments`` largest segments: None for all).
    Returns (trace, [AllocatorView], hover texts per event). ``on_step(what)`` is called before
    each of the ``2 * len(allocators)`` replays (progress)."""
    from vmstoolkit.analysis.compare import site_of
    from vmstoolkit.pools import make_allocator, make_driver
    from vmstoolkit.pools.options import format_options
    from vmstoolkit.trace.events import Trace
    from vmstoolkit.trace.loader import load_snapshot_dict, load_trace
    from vmstoolkit.trace.replay import replay

    trace = load_trace(path)
    events = trace.alloc_free_events()
    views = []
    step = on_step or (lambda what: None)
    for name in allocators:
        step(f"{name}: the whole replay")
        driver = make_driver("sim", capacity=capacity)
        alloc = make_allocator(name, driver, **options.get(name, {}))
        try:
            res = replay(trace, alloc, timeline=True)
        finally:
            alloc.close()
        k = int(np.argmax(res.timeline["reserved"])) if len(res.timeline["reserved"]) else 0
        step(f"{name}: the layout at its peak")
        driver = make_driver("sim", capacity=capacity)
        alloc = make_allocator(name, driver, **options.get(name, {}))
        try:
            replay(Trace(name=trace.name, events=tuple(events[: k + 1]), device=trace.device), alloc)
            layout = peak_layout(driver, alloc, max_segments)
            segments = live_segments(driver)
        finally:
            alloc.close()
        views.append(AllocatorView(name, format_options(options.get(name, {})), res.timeline, res.peak_reserved, k,
                                   layout, res.oom_event, segments=len(segments),
                                   hidden_bytes=sum(segments.values()) - sum(r["size"] for r in layout)))
    raw = load_snapshot_dict(path)  # for the frames (the typed events do not keep them)
    entries = (raw.get("device_traces") or [[]])[trace.device]
    free = "free_completed" if any(e.get("action") == "free_completed" for e in entries) else "free_requested"
    kept = [e for e in entries if e.get("action") in ("alloc", free)]
    sites = [site_of(e) for e in kept] if len(kept) == len(events) else ["?"] * len(events)
    hover = [f"{e.action.value} {e.size:,} B, stream {e.stream}<br>{html.escape(s)}" for e, s in zip(events, sites)]
    return trace, views, hover


def report_html(trace, views: list[AllocatorView], hover: list[str]) -> str:
    """The page: memory over time, then one layout figure per allocator; plotly's JS inlined once."""
    go = _plotly()
    t_us = np.asarray(views[0].timeline["time_us"], dtype=np.float64) if views else np.zeros(0)
    t0 = t_us[0] if len(t_us) else 0.0
    fig = go.Figure()
    first = views[0]
    alloc = np.asarray(first.timeline["allocated"])
    idx = thin_peaks(alloc)
    fig.add_trace(go.Scatter(x=((t_us[idx] - t0) / 1e6).tolist(), y=(alloc[idx] / GiB).tolist(), name="allocated", mode="lines",
                             line_shape="hv", fill="tozeroy", line={"color": "#999"},
                             hovertext=[hover[i] for i in idx], hovertemplate="%{y:.3f} GiB allocated<br>%{hovertext}"))
    for v in views:
        res = np.asarray(v.timeline["reserved"])
        t = np.asarray(v.timeline["time_us"], dtype=np.float64)
        idx = thin_peaks(res)
        fig.add_trace(go.Scatter(x=((t[idx] - t0) / 1e6).tolist(), y=(res[idx] / GiB).tolist(), name=f"{v.name} reserved", mode="lines",
                                 line_shape="hv", hovertext=[hover[i] for i in idx],
                                 hovertemplate=f"{v.name}: " + "%{y:.3f} GiB reserved<br>%{hovertext}"))
    fig.update_layout(title=f"{trace.name}: memory over time", xaxis_title="seconds since the first recorded event",
                      yaxis_title="GiB", hovermode="closest", height=480)
    parts = [fig.to_html(include_plotlyjs=True, full_html=False, div_id="memory-over-time")]
    colours = {"mapped": "#9ecae1", "stitched": "#fd8d3c", "live": "#08519c"}
    for v in views:
        lay = go.Figure()
        labels = [f"{i}: {r['size'] / MiB:,.0f} MiB at {r['base']:#x}" for i, r in enumerate(v.layout)]
        for kind in ("mapped", "stitched", "live"):
            xs, bases, ys = [], [], []
            for label, r in zip(labels, v.layout):
                for start, size, k in (r["live"] if kind == "live" else r["chunks"]):
                    if k == kind:
                        xs.append(size / MiB)
                        bases.append(start / MiB)
                        ys.append(label)
            lay.add_trace(go.Bar(x=xs, base=bases, y=ys, orientation="h", name=kind, marker_color=colours[kind],
                                 width=0.8 if kind != "live" else 0.45,
                                 hovertemplate="%{y}<br>" + kind + " from %{base:.1f} MiB, %{x:.1f} MiB<extra></extra>"))
        lay.update_layout(title=f"{v.name}{' ' + v.options if v.options else ''}: segments at its peak reserved "
                                f"({v.peak_reserved / GiB:.2f} GiB, event {v.peak_index})"
                                + (f"; OOM at event {v.oom_event}" if v.oom_event is not None else "")
                                + (f"<br>the {len(v.layout)} largest of {v.segments} segments drawn; {v.hidden} smaller "
                                   f"ones ({v.hidden_bytes / GiB:.2f} GiB) are not: --segments all draws every one"
                                   if v.hidden else ""),
                          barmode="overlay", xaxis_title="MiB from the segment's start",
                          yaxis={"autorange": "reversed"}, height=max(300, 22 * len(v.layout) + 160))
        parts.append(lay.to_html(include_plotlyjs=False, full_html=False, div_id=f"layout-{v.name}"))
    head = (f"<title>vmstoolkit view: {html.escape(trace.name)}</title><meta charset='utf-8'>"
            "<style>body{font-family:sans-serif;margin:1em 2em}</style>")
    intro = (f"<h1>{html.escape(trace.name)}</h1><p>{len(hover):,} events replayed through "
             f"{', '.join(html.escape(v.name) for v in views)} on the simulated driver. Zoom by dragging; "
             "hover for the event's size, stream and Python frame. Layout: light blue = mapped chunks, "
             "orange = chunks mapped in more than one range (stitched), dark blue = live blocks.</p>")
    return f"<!DOCTYPE html><html><head>{head}</head><body>{intro}{''.join(parts)}</body></html>\n"
