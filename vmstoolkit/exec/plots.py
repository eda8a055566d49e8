"""Figures of a run of the runtime: the schedule one run executed, simulated or measured, and
:func:`save_schedules`, which writes a budget's runs under each executor (figure and spans).

:func:`plot_schedule` draws the ``spans`` a backend records (``SimBackend.spans``, or
``CudaBackend(timeline=True).spans`` measured with CUDA events): one lane per stream of each GPU,
one bar per vertex, coloured by what it does (forward, backward and optimizer kernels, offloads,
reloads). Drawn side by side, two executors' schedules show where one waits and the other does
not. (The makespan-against-budget figure is :func:`vmstoolkit.exec.experiment.plot_makespan`.)
"""

from __future__ import annotations

KIND_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
               "offload": "tab:red", "reload": "tab:purple",
               "move": "tab:brown"}
BACKWARD_OPS = frozenset({"linear_dx", "linear_dw", "rmsnorm_dx", "rmsnorm_dw", "rope_backward",
                          "attention_backward", "swiglu_backward"})
OPTIMIZER_OPS = frozenset({"adamw"})
STREAM_LANES = ("d2h", "h2d", "compute")  # bottom to top within a GPU


def vertex_kind(mg, vid: int) -> str:
    """What memory-graph vertex ``vid`` does: ``offload``, ``reload``, ``move``, or a compute vertex's
    ``forward``, ``backward`` (the backward ops, and vertices named ``.dx``, ``.dh`` or ``.back``)
    or ``optimizer``."""
    v = mg.vertices[vid]
    if v.kind != "compute":
        return v.kind
    if v.op in OPTIMIZER_OPS:
        return "optimizer"
    if v.op in BACKWARD_OPS or v.name.endswith((".dx", ".dh")) or ".back" in v.name:
        return "backward"
    return "forward"


def plot_schedule(mg, spans, ax=None, title: str | None = None, unit: str = "ms"):
    """Draw ``spans`` (``(vertex, gpu, stream, start_s, end_s)``) of memory graph ``mg`` on
    ``ax`` (a new Figure's when None); returns the Axes. ``unit``: ``"ms"`` or ``"us"`` on the
    time axis; the legend names the kinds drawn. No pyplot: the caller's backend is left alone."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    scale = {"ms": 1e3, "us": 1e6}[unit]
    if ax is None:
        ax = Figure(figsize=(11, 1.2 + 0.9 * mg.n_gpus)).subplots()
    lanes = {(g, s): g * (len(STREAM_LANES) + 1) + i for g in range(mg.n_gpus) for i, s in enumerate(STREAM_LANES)}
    seen = set()
    for vid, gpu, stream, start, end in spans:
        kind = vertex_kind(mg, vid)
        seen.add(kind)
        ax.barh(lanes[(gpu, stream)], (end - start) * scale, left=start * scale, color=KIND_COLORS[kind], height=0.8)
    ax.set_yticks(list(lanes.values()), [f"gpu{g} {s}" if mg.n_gpus > 1 else s for g, s in lanes])
    ax.set_xlabel(f"time ({'µs' if unit == 'us' else 'ms'})")
    if title:
        ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items() if k in seen], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)  # beside the lanes, not over them
    return ax


def schedules_figure(runs: dict, clock: str):
    """One Figure with the schedules of several runs one above the other, on one time axis:
    ``runs`` maps a label (an executor) to ``(memory graph, seconds, spans)``; ``clock`` says
    what measured them (``"simulated"``, ``"GPU, CUDA events"``). Returns the Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.8 * len(runs) + 0.6))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, (mg, seconds, spans)) in zip(axes, runs.items()):
        plot_schedule(mg, spans, ax=ax, title=f"{label}: {seconds:.4g} s ({clock})")
    fig.tight_layout()
    return fig


def save_schedules(folder, budget: int, last: dict, clock: str, stem: str | None = None) -> None:
    """``<folder>/<stem>.png`` and ``.json`` (``stem`` default ``schedule_<budget bytes>B``):
    ``last`` maps each executor to the ``(memory graph, seconds, spans)`` of one run at
    ``budget`` bytes; ``clock`` says what measured them."""
    import json
    from pathlib import Path

    from vmstoolkit.units import format_size

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = stem or f"schedule_{budget}B"  # bytes: a size with a decimal point would read as a suffix
    (folder / f"{stem}.json").write_text(json.dumps(
        {"budget": budget, **{ex: {"seconds": s, "spans": sp} for ex, (_, s, sp) in last.items()}}))
    fig = schedules_figure({f"{ex}, budget {format_size(budget)}": run for ex, run in last.items()}, clock)
    fig.savefig(folder / f"{stem}.png", dpi=110)
