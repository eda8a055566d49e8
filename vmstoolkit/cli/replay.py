"""``vmstoolkit replay``: replay snapshots through allocators and print their figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vmstoolkit.cli.common import (
    OOM_EXIT_CODE, Device, OutputFormat, allocator_options, check_allocators, emit_rows, fail, load_options,
    size_option,
)
from vmstoolkit.cli.allocators import warn_ineffective
from vmstoolkit.cli.flags import (
    OOM_HELP, OPTION_HELP, allocator_flag, backend_flag, capacity_flag, capacity_label, format_flag, gpu_flag,
    lenient_flag, max_bytes_flag, max_objects_flag, oom_exit_code_flag, option_flag,
)
from vmstoolkit.cli.progress import event_callback, progress_bar
from vmstoolkit.units import format_size

__all__ = ["OOM_HELP", "OPTION_HELP", "replay_command", "replay_table", "result_row", "trace_files"]


def trace_files(items: list[Path] | None) -> list[Path]:
    """The snapshots that ``TRACE`` arguments name: files as given, a folder for the snapshots
    directly in it (as ``sweep`` takes them), none for the bundled traces. Exits with one line on
    a missing file or a folder without snapshots."""
    from vmstoolkit.analysis.sweep import SNAPSHOT_SUFFIXES, snapshot_paths
    from vmstoolkit.trace import bundled_trace_paths

    if not items:
        return bundled_trace_paths()
    for p in items:
        if not Path(p).exists():
            fail(f"no such trace file: {p}")
        if Path(p).is_dir() and not snapshot_paths([p]):
            fail(f"no snapshots ({', '.join(SNAPSHOT_SUFFIXES)}) in folder {p}", code=2)
    return snapshot_paths(items)


def result_row(result, *, source: str = "", source_sha256: str | None = None, capacity: int | None = None,
               options: dict | None = None) -> dict:
    """The flat row of one replay (:func:`vmstoolkit.analysis.rows.replay_row`)."""
    from vmstoolkit.analysis.rows import replay_row

    return replay_row(result, source=source, source_sha256=source_sha256, capacity=capacity, options=options)


def replay_command(
    traces: Annotated[Optional[list[Path]], typer.Argument(
        help="PyTorch memory snapshots (.pickle or .pickle.gz), or folders of them (each snapshot directly "
             "in a folder). None: the bundled H200 traces.",
        metavar="TRACE", show_default=False)] = None,
    allocator: Annotated[Optional[list[str]], allocator_flag("vms")] = None,
    capacity: Annotated[Optional[str], capacity_flag()] = None,
    fmt: Annotated[OutputFormat, format_flag()] = OutputFormat.table,
    device: Annotated[Device, backend_flag("Driver", "--device")] = Device.sim,
    touch: Annotated[bool, typer.Option(help="Write every allocation once (memset) to prove it is mapped.")] = False,
    option: Annotated[Optional[list[str]], option_flag()] = None,
    oom_exit_code: Annotated[int, oom_exit_code_flag()] = OOM_EXIT_CODE,
    gpu: Annotated[Optional[int], gpu_flag("Replay only this device of the snapshots (default: every device with events).")] = None,
    lenient: Annotated[bool, lenient_flag()] = False,
    max_bytes: Annotated[Optional[str], max_bytes_flag()] = None,
    max_objects: Annotated[Optional[int], max_objects_flag()] = None,
) -> None:
    """Replay snapshots through allocators: peak allocated, peak reserved, utilization, fragmentation.

    Every row names the trace, its file's SHA-256, the allocator and its options, the capacity and
    the toolkit's version; JSON and CSV carry the same flat columns (driver_calls.create, ...).
    """
    from vmstoolkit.analysis.rows import file_sha256
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY
    from vmstoolkit.trace.loader import load_traces
    from vmstoolkit.trace.run import replay_trace

    names = list(allocator or ["vms"])
    check_allocators(names)
    cap = size_option(capacity, "--capacity")
    load = load_options(gpu, lenient, max_bytes, max_objects)
    options = allocator_options(option, names, cap, device)
    warn_ineffective(options)
    paths = trace_files(traces)
    device = Device(device)
    row_capacity = (cap or DEFAULT_CAPACITY) if device is Device.sim else None
    rows = []
    with progress_bar() as progress:
        for path in paths:
            loaded = load_traces(path, device=load["gpu"], lenient=load["lenient"], max_bytes=load["max_bytes"],
                                 max_objects=load["max_objects"])
            digest = file_sha256(path)  # after the load has checked the file: a 20 GB non-pickle fails at byte 0
            for trace in loaded:
                for name in names:
                    task = progress.add_task(f"{Path(path).name} / gpu {trace.device} / {name}", total=None)
                    result = replay_trace(trace, name, capacity=cap, device=device.value, touch=touch, options=options[name],
                                          progress=event_callback(progress, task))
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

    caps = list(dict.fromkeys(capacity_label(r["capacity"]) for r in rows))
    lines = [f"capacity {', '.join(caps)}; vmstoolkit {__version__}"]
    lines += [f"{t}: sha256 {h[:16]}" for t, h in dict.fromkeys((r["trace"], r["source_sha256"] or "") for r in rows) if h]
    if any(r["oom"] for r in rows):
        lines.append(f"OOM: out of memory at that event; the row's figures cover only the events before it. "
                     f"Exit status {oom_exit_code} (--oom-exit-code).")
    t = Table(title=f"Replay on {', '.join(caps)}", caption="\n".join(lines), caption_justify="left", box=box.SIMPLE_HEAD,
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
