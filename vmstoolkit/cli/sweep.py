"""``vmstoolkit sweep``: snapshots x allocators x a grid of allocator options, locally or on a cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vmstoolkit.cli.common import (
    OOM_EXIT_CODE, OutputFormat, allocator_options, check_allocators, emit_rows, fail, load_options, option_value,
    size_option,
)
from vmstoolkit.cli.allocators import ineffective
from vmstoolkit.cli.flags import (
    allocator_flag, capacity_flag, capacity_label, cluster_flag, format_flag, gpu_flag, jobs_flag, lenient_flag,
    max_bytes_flag, max_objects_flag, oom_exit_code_flag, option_flag,
)
from vmstoolkit.cli.progress import progress_bar
from vmstoolkit.errors import VmsError
from vmstoolkit.units import format_size

# PyTorch's allocator settings are one comma-separated string: never split its values.
UNSPLIT_KEYS = ("config",)


def parse_grid(items: list[str] | None, names: list[str] | None = None) -> dict[str, list]:
    """``["reuse_max_ratio=1,2", "stitched_prefix=true,false"]`` -> ``{"reuse_max_ratio": [1.0, 2.0],
    "stitched_prefix": [True, False]}``; each value converted and checked as ``-o KEY=VALUE`` is for
    the allocators ``names`` (default: vms). Repeating a key adds values; ``config=`` values are not
    split (PyTorch's string has commas: repeat it)."""
    names = names or ["vms"]
    grid: dict[str, list] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            fail(f"--grid takes KEY=VALUE[,VALUE...], got {item!r}", code=2)
        parts = [values] if key in UNSPLIT_KEYS else values.split(",")
        for v in parts:
            if not v.strip():
                fail(f"--grid {item!r}: an empty value", code=2)
            value = option_value(key, v, names)
            if value in grid.setdefault(key, []):
                fail(f"--grid {item!r}: {key}={v} is given twice", code=2)
            grid[key].append(value)
    return grid


def sweep_command(
    traces: Annotated[Optional[list[Path]], typer.Argument(
        help="Snapshots (.pickle, .pickle.gz) or folders of them. None: the bundled H200 traces.",
        metavar="TRACE", show_default=False)] = None,
    allocator: Annotated[Optional[list[str]], allocator_flag("vms")] = None,
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", "-g", metavar="KEY=V1,V2",
        help="Allocator option and its values, repeatable: every combination is replayed, e.g. "
             "-g stitched_prefix=true,false -g reuse_max_ratio=1,2. Each option must suit every allocator.")] = None,
    option: Annotated[Optional[list[str]], option_flag()] = None,
    capacity: Annotated[Optional[str], capacity_flag()] = None,
    jobs: Annotated[Optional[int], jobs_flag()] = None,
    cluster: Annotated[Optional[str], cluster_flag()] = None,
    fmt: Annotated[OutputFormat, format_flag()] = OutputFormat.table,
    oom_exit_code: Annotated[int, oom_exit_code_flag()] = OOM_EXIT_CODE,
    gpu: Annotated[Optional[int], gpu_flag("Device of the snapshots to replay (default: the busiest).")] = None,
    lenient: Annotated[bool, lenient_flag()] = False,
    max_bytes: Annotated[Optional[str], max_bytes_flag()] = None,
    max_objects: Annotated[Optional[int], max_objects_flag()] = None,
) -> None:
    """Replay every snapshot through every allocator under every combination of the grid's
    options (and the fixed ones of -o); print peak reserved, utilization and each run against the
    trace's best."""
    from collections import defaultdict

    from vmstoolkit.analysis.runner import check_cluster_spec, run_jobs
    from vmstoolkit.analysis.sweep import plan_sweep, run_sweep_job, snapshot_paths, sweep_rows
    from vmstoolkit.pools import make_allocator
    from vmstoolkit.trace import bundled_trace_paths
    from vmstoolkit.trace.loader import trace_name

    names = list(allocator) if allocator else ["vms"]
    check_allocators(names)
    if jobs is not None and jobs < 1:
        fail(f"--jobs must be at least 1, got {jobs}", code=2)
    cap = size_option(capacity, "--capacity")
    load = load_options(gpu, lenient, max_bytes, max_objects)
    fixed = allocator_options(option, names, cap)
    options_grid = parse_grid(grid, names)
    paths = snapshot_paths(traces) if traces else bundled_trace_paths()
    if not paths:
        fail(f"no snapshots (.pickle, .pickle.gz) in {', '.join(map(str, traces or []))}", code=2)
    for p in paths:
        if not p.is_file():
            fail(f"no such trace file: {p}", code=2)
    by_name: dict[str, list[Path]] = defaultdict(list)
    for p in paths:
        by_name[trace_name(p)].append(p)
    for name, same in by_name.items():
        if len(same) > 1:  # rows, and each run against "the trace's best", go by this name
            fail(f"two snapshots have the trace name {name!r}: {same[0]} and {same[1]}; rename one of them", code=2)
    try:
        if cluster is not None:
            cluster = check_cluster_spec(cluster)
        job_list = plan_sweep(paths, names, options_grid, cap, fixed=fixed, load=load)
        for name, opts in dict.fromkeys((j.allocator, j.options) for j in job_list):
            make_allocator(name, capacity=cap, **dict(opts)).close()  # every option checked before any replay
    except VmsError as e:
        fail(str(e), code=2)
    for line in dict.fromkeys(x for j in job_list for x in ineffective(j.allocator, dict(j.options))):
        typer.secho(f"note: {line}", err=True, fg="yellow")
    n_workers = jobs or os.cpu_count() or 1
    with progress_bar() as progress:
        task = progress.add_task(f"sweep: {len(job_list)} replays ({min(n_workers, len(job_list))} workers)",
                                 total=len(job_list))
        results = run_jobs(run_sweep_job, job_list, n_workers, cluster=cluster,
                           on_done=lambda job, r: progress.update(task, advance=1,
                                                                  description=f"{r['trace']} / {r['allocator']}"))
    rows = sweep_rows(results)
    emit_rows(rows, fmt, sweep_table)
    if oom_exit_code and any(r["oom"] for r in rows):
        raise typer.Exit(code=oom_exit_code)


def sweep_table(rows: list[dict]) -> Table:
    caps = ", ".join(dict.fromkeys(capacity_label(r["capacity"]) for r in rows))
    t = Table(title=f"Sweep on {caps}: peak reserved per allocator and options",
              caption="vs best: peak reserved / the lowest peak reserved of that trace without OOM")
    for col in ("trace", "allocator", "options", "peak allocated", "peak reserved", "utilization", "vs best",
                "OOM", "driver calls"):
        t.add_column(col, justify="left" if col in ("trace", "allocator", "options") else "right")
    for r in rows:
        t.add_row(r["trace"], r["allocator"], r["options"] or "(defaults)", format_size(r["peak_allocated"]),
                  format_size(r["peak_reserved"]), f"{r['utilization']:.4f}",
                  "-" if r["vs_best"] is None else f"{r['vs_best']:.3f}", "yes" if r["oom"] else "no",
                  str(r["driver_calls"]))
    return t
