"""``vmstoolkit replay``: replay snapshots through allocators and print their figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vmstoolkit.cli.common import OutputFormat, fail, json_lines, load_options, parse_options, rows_to_csv, size_option
from vmstoolkit.errors import VmsError
from vmstoolkit.units import format_size

REPLAY_KEYS = ("trace", "allocator", "events", "peak_allocated", "peak_reserved", "utilization",
               "fragmentation", "oom", "driver_calls", "seconds", "events_per_second", "device", "unmatched_frees",
               "preexisting_bytes", "settings_applied", "skipped_events")


def result_row(result) -> dict:
    d = result.as_dict()
    row = {k: d[k] for k in REPLAY_KEYS}
    row["seconds"] = round(row["seconds"], 4)
    row["events_per_second"] = round(row["events_per_second"], 1)
    if result.oom:
        row["oom_event"] = result.oom_event
        row["oom_message"] = result.oom_message
    row.update(result.extra)
    return row


def replay_command(
    traces: Annotated[list[Path], typer.Argument(help="PyTorch memory snapshots (.pickle or .pickle.gz). None: the bundled H200 traces.", show_default=False)] = None,
    allocator: Annotated[list[str], typer.Option("--allocator", "-a", help="Allocator to replay through; repeat for several. See `vmstoolkit allocators`.")] = None,
    capacity: Annotated[Optional[str], typer.Option(help="Device memory for the simulated driver, e.g. 80GiB (default 141GiB, an H200).")] = None,
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    device: Annotated[str, typer.Option(help="Driver: 'sim' (simulated, default) or 'cuda' (really map GPU memory).")] = "sim",
    touch: Annotated[bool, typer.Option(help="Write every allocation once (memset) to prove it is mapped.")] = False,
    option: Annotated[list[str], typer.Option("--option", "-o", help="Allocator option KEY=VALUE, repeatable: e.g. reuse_max_ratio=2 or stitch_min_bytes=64MiB (vms, gmlake), slack_pages=128 or reclaim=clock (paged), config=max_split_size_mb:128 (pytorch-*: replaces the snapshot's recorded settings).")] = None,
    gpu: Annotated[Optional[int], typer.Option(help="Replay only this device of the snapshots (default: every device with events).")] = None,
    lenient: Annotated[bool, typer.Option(help="Skip and count corrupt events (double allocs, overlaps, size-mismatched frees) instead of failing.")] = False,
    max_bytes: Annotated[Optional[str], typer.Option(help="Most decompressed bytes read from a snapshot, e.g. 64GiB (default 32 GiB, and 100x the size of a gzip file).")] = None,
    max_objects: Annotated[Optional[int], typer.Option(help="Most pickle values built while reading a snapshot (default 1e9).")] = None,
) -> None:
    """Replay snapshots through allocators: peak allocated, peak reserved, utilization, fragmentation."""
    from vmstoolkit.pools import allocator_names
    from vmstoolkit.trace import bundled_trace_paths
    from vmstoolkit.trace.loader import load_traces
    from vmstoolkit.trace.run import replay_trace

    names = allocator or ["vms"]
    known = allocator_names()
    for n in names:
        if n not in known:
            fail(f"unknown allocator {n!r}; choose one of: {', '.join(known)}", code=2)
    cap = size_option(capacity, "--capacity")
    if device not in ("sim", "cuda"):
        fail(f"unknown device {device!r} (choose 'sim' or 'cuda')", code=2)
    load = load_options(gpu, lenient, max_bytes, max_objects)
    options = parse_options(option)
    if options:
        from vmstoolkit.pools import make_allocator

        for n in names:  # check the options against every chosen allocator before replaying
            try:
                make_allocator(n, **options)
            except VmsError as e:
                fail(str(e), code=2)
    paths = list(traces) if traces else bundled_trace_paths()
    err = Console(stderr=True)
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        for path in paths:
            try:
                loaded = load_traces(path, device=load["gpu"], lenient=load["lenient"], max_bytes=load["max_bytes"],
                                     max_objects=load["max_objects"])
            except VmsError as e:
                fail(str(e))
            for trace in loaded:
                for name in names:
                    task = progress.add_task(f"{Path(path).name} / gpu {trace.device} / {name}", total=None)
                    try:
                        result = replay_trace(trace, name, capacity=cap, device=device, touch=touch, options=options,
                                              progress=lambda done, total, t=task: progress.update(t, completed=done, total=total))
                    except VmsError as e:
                        fail(str(e))
                    progress.remove_task(task)
                    rows.append(result_row(result))
    if fmt is OutputFormat.json:
        typer.echo(json_lines(rows), nl=False)
    elif fmt is OutputFormat.csv:
        typer.echo(rows_to_csv(rows), nl=False)
    else:
        Console().print(replay_table(rows))


def replay_table(rows: list[dict]) -> Table:
    t = Table(title="Replay")
    for col in ("trace", "device", "allocator", "events", "peak allocated", "peak reserved", "utilization", "OOM",
                "driver calls", "events/s", "pre-existing", "unmatched frees"):
        t.add_column(col, justify="left" if col in ("trace", "allocator") else "right")
    for r in rows:
        t.add_row(r["trace"], str(r["device"]), r["allocator"], str(r["events"]), format_size(r["peak_allocated"]),
                  format_size(r["peak_reserved"]), f"{r['utilization']:.4f}", "yes" if r["oom"] else "no",
                  str(sum(r["driver_calls"].values())), f"{r['events_per_second']:.0f}",
                  format_size(r["preexisting_bytes"]), str(r["unmatched_frees"]))
    return t


def allocators_command() -> None:
    """List the allocators and what each one is."""
    from vmstoolkit.pools import describe_allocators

    t = Table(title="Allocators")
    t.add_column("name")
    t.add_column("what it is")
    for name, desc in describe_allocators().items():
        t.add_row(name, desc)
    Console().print(t)
