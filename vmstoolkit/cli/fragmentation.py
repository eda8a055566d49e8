"""``vmstoolkit experiment fragmentation``: the paper's fragmentation table and figures."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vmstoolkit.cli.common import fail, load_options
from vmstoolkit.errors import VmsError

GiB = 1 << 30


def machine_description() -> str:
    """One line naming the machine the experiment ran on."""
    return (f"{platform.node() or 'unknown host'}: {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}")


def fragmentation_table(rows: list[dict], allocators: list[str]) -> Table:
    """The paper-style table: per workload, each allocator's peak reserved and utilization, and
    what ``vms`` saves against each baseline."""
    from vmstoolkit.analysis.fragmentation import OURS
    from vmstoolkit.trace.synthetic import SYNTHETIC_NOTE

    synthetic = any(r["synthetic"] for r in rows)
    t = Table(title="Fragmentation: peak reserved (utilization = peak allocated / peak reserved)",
              caption=f"* {SYNTHETIC_NOTE}" if synthetic else None)
    t.add_column("workload")
    t.add_column("peak allocated", justify="right")
    for a in allocators:
        t.add_column(f"{a}\nreserved (util)", justify="right")
    baselines = [a for a in allocators if a != OURS] if OURS in allocators else []
    for a in baselines:
        t.add_column(f"vms saves vs\n{a}", justify="right")
    for r in rows:
        cells = [r["workload"] + (" *" if r["synthetic"] else ""), f"{r['peak_allocated'] / GiB:.2f} GiB"]
        for a in allocators:
            res = r.get(f"{a}.peak_reserved")
            if res is None:
                cells.append("-")
            else:
                oom = " OOM" if r.get(f"{a}.oom") else ""
                cells.append(f"{res / GiB:.2f} GiB ({100 * r[f'{a}.utilization']:.1f}%){oom}")
        for a in baselines:
            gib = r.get(f"vms_saved_vs_{a}.gib")
            cells.append("-" if gib is None else f"{gib:+.2f} GiB ({r[f'vms_saved_vs_{a}.pct']:+.1f}%)")
        t.add_row(*cells)
    return t


def fragmentation_command(
    traces: Annotated[Optional[list[str]], typer.Argument(
        help="Snapshots (.pickle/.pickle.gz) or synthetic:KIND[:SEED]. None: the bundled H200 traces.",
        show_default=False)] = None,
    allocator: Annotated[Optional[list[str]], typer.Option(
        "--allocator", "-a", help="Allocator to compare; repeat for several. Default: pytorch-caching, "
                                  "pytorch-expandable, gmlake, vms (those registered).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for the CSV, JSON and PNG figures.")] = Path("fragmentation-results"),
    jobs: Annotated[Optional[int], typer.Option(help="Worker processes for the replays (default: the machine's cores).")] = None,
    synthetic: Annotated[bool, typer.Option(
        help="Add one SYNTHETIC trace of every kind (recompute, LoRA, offload, ZeRO, growing sequences, ...).")] = False,
    timeline: Annotated[Optional[str], typer.Option(
        help="Workload whose reserved/allocated timeline is drawn (default: the first).")] = None,
    gpu: Annotated[Optional[int], typer.Option(help="Device of the snapshots to replay (default: the busiest).")] = None,
    lenient: Annotated[bool, typer.Option(help="Skip and count corrupt events instead of failing.")] = False,
    max_bytes: Annotated[Optional[str], typer.Option(help="Most decompressed bytes read from a snapshot, e.g. 64GiB (default 32 GiB, and 100x the size of a gzip file).")] = None,
    max_objects: Annotated[Optional[int], typer.Option(help="Most pickle values built while reading a snapshot (default 1e9).")] = None,
) -> None:
    """Replay traces through the allocators and print the fragmentation table; write it as CSV
    and JSON with figures (utilization per workload, memory over time for one trace)."""
    from vmstoolkit.analysis.fragmentation import (
        DEFAULT_ALLOCATORS, default_specs, fragmentation_rows, plan_jobs, run_jobs, spec_workload, write_outputs,
    )
    from vmstoolkit.pools import allocator_names
    from vmstoolkit.trace.synthetic import KINDS, is_synthetic_spec

    known = allocator_names()
    names = list(allocator) if allocator else [a for a in DEFAULT_ALLOCATORS if a in known]
    for n in names:
        if n not in known:
            fail(f"unknown allocator {n!r}; choose one of: {', '.join(known)}", code=2)
    if len(set(names)) != len(names):
        fail("an allocator is named twice", code=2)
    if jobs is not None and jobs < 1:
        fail(f"--jobs must be at least 1, got {jobs}", code=2)
    specs = list(traces) if traces else default_specs()
    if synthetic:
        specs += [f"synthetic:{k}" for k in KINDS if f"synthetic:{k}" not in specs]
    try:
        for s in specs:
            if not is_synthetic_spec(s) and not Path(s).is_file():
                fail(f"no such trace file: {s}")
        workloads = [spec_workload(s) for s in specs]
    except VmsError as e:
        fail(str(e), code=2)
    if len(set(workloads)) != len(workloads):
        fail("two traces have the same workload name; give each once", code=2)
    chosen = timeline or workloads[0]
    if chosen not in workloads:
        fail(f"--timeline {chosen!r} is not one of the workloads: {', '.join(workloads)}", code=2)

    job_list = plan_jobs(specs, names, chosen, load=load_options(gpu, lenient, max_bytes, max_objects))
    n_workers = jobs or os.cpu_count() or 1
    err = Console(stderr=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as progress:
            task = progress.add_task(f"replaying {len(specs)} traces x {len(names)} allocators "
                                     f"({min(n_workers, len(job_list))} workers)", total=len(job_list))
            results = run_jobs(job_list, n_workers,
                               on_done=lambda job, r: progress.update(task, advance=1, description=f"{r.trace} / {r.allocator}"))
    except VmsError as e:
        fail(str(e))
    rows = fragmentation_rows(specs, names, results)
    out_console = Console()
    if not out_console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        out_console = Console(width=220)
    out_console.print(fragmentation_table(rows, names))
    argv = sys.argv[1:]
    if "fragmentation" in argv:  # the vmstoolkit command (or experiments/fragmentation.py): name it as typed
        command = "vmstoolkit experiment fragmentation " + shlex.join(argv[argv.index("fragmentation") + 1:])
    else:
        command = shlex.join(["python", sys.argv[0], *argv])
    written = write_outputs(out, rows, results, allocators=names, timeline_workload=chosen,
                            command=command, machine=machine_description())
    for p in written:
        err.print(f"wrote {p}")
