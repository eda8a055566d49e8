"""``vmstoolkit replay``: replay snapshots through allocators and print their figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vmstoolkit.cli.common import (
    OOM_EXIT_CODE, Device, OutputFormat, allocator_options, check_allocators, console, emit_rows, fail, load_options,
    size_option,
)
from vmstoolkit.units import format_size

OPTION_HELP = ("Allocator option KEY=VALUE (every chosen allocator that takes KEY) or ALLOC:KEY=VALUE "
               "(that one), pairs joined by commas, repeatable: e.g. vms:reuse_max_ratio=2,coalesce=false, "
               "stitch_min_bytes=64MiB (vms, gmlake), "
               "slack_pages=128 (paged), config=max_split_size_mb:128 (pytorch-*).")
OOM_HELP = ("Exit status when a replay runs out of memory (the output is complete either way); 0: exit 0. "
            "Errors exit 1, bad arguments 2.")


def result_row(result, *, source: str = "", source_sha256: str | None = None, capacity: int | None = None,
               options: dict | None = None) -> dict:
    """The flat row of one replay (:func:`vmstoolkit.analysis.rows.replay_row`)."""
    from vmstoolkit.analysis.rows import replay_row

    return replay_row(result, source=source, source_sha256=source_sha256, capacity=capacity, options=options)


def replay_command(
    traces: Annotated[Optional[list[Path]], typer.Argument(
        help="PyTorch memory snapshots (.pickle or .pickle.gz). None: the bundled H200 traces.",
        metavar="TRACE", show_default=False)] = None,
    allocator: Annotated[Optional[list[str]], typer.Option(
        "--allocator", "-a", metavar="NAME",
        help="Allocator to replay through; repeat for several (default: vms). See `vmstoolkit allocators`.")] = None,
    capacity: Annotated[Optional[str], typer.Option(
        metavar="SIZE", help="Device memory for the simulated driver, e.g. 80GiB (default 141GiB, an H200).")] = None,
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    device: Annotated[Device, typer.Option(
        help="Driver: 'sim' (simulated, default) or 'cuda' (really map GPU memory).")] = Device.sim,
    touch: Annotated[bool, typer.Option(help="Write every allocation once (memset) to prove it is mapped.")] = False,
    option: Annotated[Optional[list[str]], typer.Option("--option", "-o", metavar="[ALLOC:]KEY=VALUE",
                                                        help=OPTION_HELP)] = None,
    oom_exit_code: Annotated[int, typer.Option(metavar="N", min=0, max=255, help=OOM_HELP)] = OOM_EXIT_CODE,
    gpu: Annotated[Optional[int], typer.Option(metavar="N", help="Replay only this device of the snapshots (default: every device with events).")] = None,
    lenient: Annotated[bool, typer.Option(help="Skip and count corrupt events (double allocs, overlaps, size-mismatched frees) instead of failing.")] = False,
    max_bytes: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Most decompressed bytes read from a snapshot, e.g. 64GiB (default 32 GiB, and 100x the size of a gzip file).")] = None,
    max_objects: Annotated[Optional[int], typer.Option(metavar="N", help="Most pickle values built while reading a snapshot (default 1e9).")] = None,
) -> None:
    """Replay snapshots through allocators: peak allocated, peak reserved, utilization, fragmentation.

    Every row names the trace, its file's SHA-256, the allocator and its options, the capacity and
    the toolkit's version; JSON and CSV carry the same flat columns (driver_calls.create, ...).
    """
    from vmstoolkit.analysis.rows import file_sha256
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY
    from vmstoolkit.trace import bundled_trace_paths
    from vmstoolkit.trace.loader import load_traces
    from vmstoolkit.trace.run import replay_trace

    names = list(allocator or ["vms"])
    check_allocators(names)
    cap = size_option(capacity, "--capacity")
    load = load_options(gpu, lenient, max_bytes, max_objects)
    options = allocator_options(option, names, cap, device)
    paths = list(traces) if traces else bundled_trace_paths()
    for p in paths:
        if not Path(p).exists():
            fail(f"no such trace file: {p}")
    device = Device(device)
    row_capacity = (cap or DEFAULT_CAPACITY) if device is Device.sim else None
    err = console(stderr=True)
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        for path in paths:
            loaded = load_traces(path, device=load["gpu"], lenient=load["lenient"], max_bytes=load["max_bytes"],
                                 max_objects=load["max_objects"])
            digest = file_sha256(path)  # after the load has checked the file: a 20 GB non-pickle fails at byte 0
            for trace in loaded:
                for name in names:
                    task = progress.add_task(f"{Path(path).name} / gpu {trace.device} / {name}", total=None)
                    result = replay_trace(trace, name, capacity=cap, device=device.value, touch=touch, options=options[name],
                                          progress=lambda done, total, t=task: progress.update(t, completed=done, total=total))
                    progress.remove_task(task)
                    rows.append(result_row(result, source=str(path), source_sha256=digest, capacity=row_capacity,
                                           options=options[name]))
    emit_rows(rows, fmt, lambda rows: replay_table(rows, oom_exit_code))
    if oom_exit_code and any(r["oom"] for r in rows):
        raise typer.Exit(code=oom_exit_code)


def replay_table(rows: list[dict], oom_exit_code: int = OOM_EXIT_CODE) -> Table:
    """The rows as a table that wraps to the terminal's width: the trace with its device, the
    allocator with its options, the figures; what every row shares (capacity, version, the files'
    SHA-256) in the caption. A replay that ran out of memory reads OOM in red where its peak
    reserved and utilization would be (they cover only the events before it)."""
    from rich import box

    from vmstoolkit import __version__

    caps = sorted({format_size(r["capacity"]) if r["capacity"] else "the device's" for r in rows})
    lines = [f"capacity {', '.join(caps)}; vmstoolkit {__version__}"]
    lines += [f"{t}: sha256 {h[:16]}" for t, h in dict.fromkeys((r["trace"], r["source_sha256"] or "") for r in rows) if h]
    if any(r["oom"] for r in rows):
        lines.append(f"OOM: out of memory at that event; the row's figures cover only the events before it. "
                     f"Exit status {oom_exit_code} (--oom-exit-code).")
    t = Table(title="Replay", caption="\n".join(lines), caption_justify="left", box=box.SIMPLE_HEAD,
              expand=True)
    t.add_column("trace", overflow="fold", ratio=1)
    t.add_column("allocator", overflow="fold", ratio=1)
    for col in ("peak\nallocated", "peak\nreserved", "utilization", "driver\ncalls", "events/s", "pre-\nexisting",
                "unmatched\nfrees"):
        t.add_column(col, justify="right")
    for r in rows:
        trace = r["trace"] if r.get("device") is None else f"{r['trace']} (device {r['device']})"
        alloc = r["allocator"] + (f" {r['options']}" if r["options"] else "")
        if r["oom"]:
            t.add_row(trace, alloc, format_size(r["peak_allocated"]), "OOM", f"OOM at\nevent {r['oom_event']}",
                      str(r["driver_calls"]), f"{r['events_per_second']:.0f}", format_size(r.get("preexisting_bytes") or 0),
                      str(r.get("unmatched_frees", 0)), style="bold red")
        else:
            t.add_row(trace, alloc, format_size(r["peak_allocated"]), format_size(r["peak_reserved"]),
                      f"{r['utilization']:.4f}", str(r["driver_calls"]), f"{r['events_per_second']:.0f}",
                      format_size(r.get("preexisting_bytes") or 0), str(r.get("unmatched_frees", 0)))
    return t


def allocators_command() -> None:
    """List the allocators, what each one is, and the options it takes."""
    from vmstoolkit.pools import describe_allocators
    from vmstoolkit.pools.registry import options_class

    t = Table(title="Allocators")
    t.add_column("name", no_wrap=True)
    t.add_column("what it is", overflow="fold")
    t.add_column("options (-o KEY=VALUE)", overflow="fold")
    for name, desc in describe_allocators().items():
        t.add_row(name, desc, ", ".join(options_class(name).keys()))
    console().print(t)
