"""``vmstoolkit compare``: two runs, or one run under several allocators, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vmstoolkit.cli.common import (
    OutputFormat, allocator_options, check_allocators, console, fail, json_lines, rows_to_csv, size_option,
)
from vmstoolkit.cli.allocators import warn_ineffective
from vmstoolkit.cli.flags import allocator_flag, capacity_flag, capacity_label, format_flag, option_flag
from vmstoolkit.cli.progress import event_callback, progress_bar
from vmstoolkit.units import format_size


def compare_command(
    traces: Annotated[list[Path], typer.Argument(metavar="A [B]", help="One or two snapshots.", show_default=False)],
    allocator: Annotated[Optional[list[str]], allocator_flag(
        "pytorch-caching; with one snapshot give two or more")] = None,
    capacity: Annotated[Optional[str], capacity_flag()] = None,
    option: Annotated[Optional[list[str]], option_flag()] = None,
    top: Annotated[int, typer.Option(metavar="N", min=1, help="Allocation sites to list.")] = 10,
    fmt: Annotated[OutputFormat, format_flag()] = OutputFormat.table,
) -> None:
    """Compare peak allocated, peak reserved and utilization of two runs (or of one run under several
    allocators; the first row is the reference of the differences), and the allocation sites that
    hold the most memory at each run's peak (from the recorded Python frames).

    JSON and CSV: one row per run (kind "run": the replay's columns and the differences), then
    one per allocation site (kind "site": site, a_bytes, b_bytes)."""
    from vmstoolkit.analysis.compare import compare_sites, peak_sites
    from vmstoolkit.analysis.rows import file_sha256, replay_row
    from vmstoolkit.trace.loader import load_snapshot_dict, load_trace
    from vmstoolkit.trace.run import replay_trace

    if len(traces) not in (1, 2):
        fail(f"compare takes one or two snapshots, got {len(traces)}", code=2)
    names = list(allocator or ["pytorch-caching"])
    check_allocators(names)
    if len(traces) == 1 and len(names) < 2:
        fail("with one snapshot, name two or more allocators to compare (-a A -a B)", code=2)
    cap = size_option(capacity, "--capacity")
    options = allocator_options(option, names, cap)
    warn_ineffective(options)
    for p in traces:
        if not p.exists():
            fail(f"no such trace file: {p}")
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY

    rows, sites = [], {}
    with progress_bar() as progress:
        for p in traces:
            trace = load_trace(p)
            digest = file_sha256(p)  # after the load has checked the file
            for n in names:
                task = progress.add_task(f"{p.name} / {n}", total=None)
                r = replay_trace(trace, n, capacity=cap, options=options[n], progress=event_callback(progress, task))
                progress.remove_task(task)
                rows.append({"kind": "run", **replay_row(r, source=str(p), source_sha256=digest,
                                                         capacity=cap or DEFAULT_CAPACITY, options=options[n])})
            sites[str(p)] = peak_sites(load_snapshot_dict(p), top=top)[1]
    ref = rows[0]
    for r in rows:
        r["peak_reserved_diff"] = r["peak_reserved"] - ref["peak_reserved"]
        r["peak_allocated_diff"] = r["peak_allocated"] - ref["peak_allocated"]
        r["utilization_diff"] = round(r["utilization"] - ref["utilization"], 6)
    keys = list(sites)
    merged = compare_sites(sites[keys[0]], sites[keys[-1]]) if len(keys) == 2 else [(s, b, b) for s, b in sites[keys[0]]]
    site_rows = [{"kind": "site", "site": s, "a_bytes": a, "b_bytes": b} for s, a, b in merged]
    if fmt is OutputFormat.json:
        typer.echo(json_lines(rows) + json_lines(site_rows), nl=False)
        return
    if fmt is OutputFormat.csv:
        typer.echo(rows_to_csv(rows + site_rows), nl=False)
        return
    t = Table(title=f"Compare on {capacity_label(cap or DEFAULT_CAPACITY)} (differences against the first row)")
    for c in ("trace", "allocator", "peak allocated", "peak reserved", "utilization", "Δ reserved", "Δ utilization"):
        t.add_column(c, justify="left" if c in ("trace", "allocator") else "right", overflow="fold")
    for r in rows:
        t.add_row(r["trace"], r["allocator"] + (f" {r['options']}" if r["options"] else ""),
                  format_size(r["peak_allocated"]), "OOM" if r["oom"] else format_size(r["peak_reserved"]),
                  "OOM" if r["oom"] else f"{r['utilization']:.4f}", format_size(r["peak_reserved_diff"]),
                  f"{r['utilization_diff']:+.4f}", style="bold red" if r["oom"] else None)
    out = console()
    out.print(t)
    s = Table(title="Allocation sites by bytes live at the peak allocated (recorded frames)")
    s.add_column("site", overflow="fold")
    if len(keys) == 2:
        for c in (Path(keys[0]).name, Path(keys[1]).name, "Δ"):
            s.add_column(c, justify="right")
        for site, a, b in merged[:top]:
            s.add_row(site, format_size(a), format_size(b), format_size(b - a))
    else:
        s.add_column("bytes", justify="right")
        for site, a, _ in merged:
            s.add_row(site, format_size(a))
    out.print(s)
