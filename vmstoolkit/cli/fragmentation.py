"""``vmstoolkit experiment fragmentation``: the paper's fragmentation table and figures."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vmstoolkit.cli.common import (
    OOM_EXIT_CODE, allocator_options, check_allocators, check_output_dir, console, fail, load_options, size_option,
)
from vmstoolkit.cli.allocators import warn_ineffective
from vmstoolkit.cli.flags import (
    allocator_flag, capacity_flag, capacity_label, cluster_flag, complete_allocator, gpu_flag, jobs_flag,
    lenient_flag, max_bytes_flag, max_objects_flag, oom_exit_code_flag, option_flag,
)
from vmstoolkit.cli.output import staged_dir
from vmstoolkit.cli.progress import progress_bar
from vmstoolkit.errors import VmsError

DEFAULT_OUT = "fragmentation-results"  # in .gitignore: a run in a checkout leaves git status clean


def machine_description() -> str:
    """One line naming the machine the experiment ran on."""
    return (f"{platform.node() or 'unknown host'}: {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}")


def fragmentation_table(rows: list[dict], allocators: list[str], baseline: str | None = None) -> Table:
    """The paper-style table: per workload, each allocator's peak reserved and utilization, and
    the savings columns (:func:`~vmstoolkit.analysis.fragmentation.savings_pairs`). What every row
    shares (capacity, version, options) is in the caption; OOM cells are red."""
    from vmstoolkit import __version__
    from vmstoolkit.analysis.fragmentation import table_cells
    from vmstoolkit.trace.synthetic import SYNTHETIC_NOTE

    head, body = table_cells(rows, allocators, baseline)
    notes = [f"capacity {capacity_label(rows[0]['capacity'])}; vmstoolkit {__version__}" if rows else ""]
    notes += [f"{a}: {rows[0][f'{a}.options']}" for a in allocators if rows and rows[0].get(f"{a}.options")]
    if any(r["synthetic"] for r in rows):
        notes.append(f"* {SYNTHETIC_NOTE}")
    on = f" on {capacity_label(rows[0]['capacity'])}" if rows else ""
    t = Table(title=f"Fragmentation{on}: peak reserved (utilization = peak allocated / peak reserved)",
              caption="\n".join(n for n in notes if n), caption_justify="left")
    for i, h in enumerate(head):
        t.add_column(h.replace(" reserved", "\nreserved").replace(" saves vs ", " saves vs\n"),
                     justify="left" if i == 0 else "right", overflow="fold")
    for cells in body:
        t.add_row(*[f"[bold red]{c}[/]" if c.startswith("OOM") else c for c in cells])
    return t


def fragmentation_command(
    traces: Annotated[Optional[list[str]], typer.Argument(
        help="Snapshots (.pickle/.pickle.gz) or synthetic:KIND[:SEED]. None: the bundled H200 traces.",
        metavar="TRACE", show_default=False)] = None,
    allocator: Annotated[Optional[list[str]], allocator_flag(
        "pytorch-caching, pytorch-expandable, gmlake, vms")] = None,
    out: Annotated[Path, typer.Option(metavar="DIR", help="Directory for the CSV, JSON and PNG figures (made if "
                                      "missing; git ignores the default one).")] = Path(DEFAULT_OUT),
    jobs: Annotated[Optional[int], jobs_flag()] = None,
    synthetic: Annotated[bool, typer.Option(
        help="Add one SYNTHETIC trace of every kind (recompute, LoRA, offload, ZeRO, growing sequences, ...).")] = False,
    timeline: Annotated[Optional[str], typer.Option(
        metavar="WORKLOAD", help="Draw the reserved/allocated timeline of this workload only (default: every workload).")] = None,
    capacity: Annotated[Optional[str], capacity_flag()] = None,
    option: Annotated[Optional[list[str]], option_flag()] = None,
    baseline: Annotated[Optional[str], typer.Option(
        metavar="NAME", autocompletion=complete_allocator,
        help="Savings columns: what every other allocator saves against this one. "
             "Default: what vms saves against every other one (the published table).")] = None,
    oom_exit_code: Annotated[int, oom_exit_code_flag()] = OOM_EXIT_CODE,
    cluster: Annotated[Optional[str], cluster_flag()] = None,
    gpu: Annotated[Optional[int], gpu_flag("Device of the snapshots to replay (default: the busiest).")] = None,
    lenient: Annotated[bool, lenient_flag()] = False,
    max_bytes: Annotated[Optional[str], max_bytes_flag()] = None,
    max_objects: Annotated[Optional[int], max_objects_flag()] = None,
) -> None:
    """Replay traces through the allocators and print the fragmentation table; write it as CSV
    and JSON with figures (utilization per workload, memory over time)."""
    from vmstoolkit.analysis.fragmentation import (
        DEFAULT_ALLOCATORS, default_specs, fragmentation_rows, plan_jobs, replay_rows, run_jobs, spec_workload,
        write_outputs,
    )
    from vmstoolkit.pools import allocator_names
    from vmstoolkit.trace.synthetic import KINDS, is_synthetic_spec

    known = allocator_names()
    names = list(allocator) if allocator else [a for a in DEFAULT_ALLOCATORS if a in known]
    check_allocators(names)
    if baseline is not None and baseline not in names:
        fail(f"--baseline {baseline!r} is not among the allocators: {', '.join(names)}", code=2)
    if jobs is not None and jobs < 1:
        fail(f"--jobs must be at least 1, got {jobs}", code=2)
    if cluster is not None:
        from vmstoolkit.analysis.runner import check_cluster_spec

        try:
            cluster = check_cluster_spec(cluster)
        except VmsError as e:
            fail(str(e), code=2)
    cap = size_option(capacity, "--capacity")
    options = allocator_options(option, names, cap)
    warn_ineffective(options)
    check_output_dir(out)
    specs = list(traces) if traces else default_specs()
    if synthetic:
        specs += [f"synthetic:{k}" for k in KINDS if f"synthetic:{k}" not in specs]
    try:
        from vmstoolkit.trace.source import regular_file

        for s in specs:
            if not is_synthetic_spec(s):
                if not Path(s).exists():
                    fail(f"no such trace file: {s}")
                regular_file(Path(s))  # a folder, /dev/zero, a FIFO: one line naming what it is
        workloads = [spec_workload(s) for s in specs]
    except VmsError as e:
        fail(str(e), code=2)
    for w in dict.fromkeys(workloads):
        same = [s for s, x in zip(specs, workloads) if x == w]
        if len(same) > 1:
            fail(f"two traces have the workload name {w!r}: {same[0]} and {same[1]}; give each once "
                 f"(or rename one)", code=2)
    if timeline is not None and timeline not in workloads:
        fail(f"--timeline {timeline!r} is not one of the workloads: {', '.join(workloads)}", code=2)

    job_list = plan_jobs(specs, names, timeline, options=options, capacity=cap,
                         load=load_options(gpu, lenient, max_bytes, max_objects))
    n_workers = jobs or os.cpu_count() or 1
    with progress_bar() as progress:
        task = progress.add_task(f"replaying {len(specs)} traces x {len(names)} allocators "
                                 f"({min(n_workers, len(job_list))} workers)", total=len(job_list))
        results = run_jobs(job_list, n_workers,
                           on_done=lambda job, r: progress.update(task, advance=1, description=f"{r.trace} / {r.allocator}"),
                           cluster=cluster)
    rows = fragmentation_rows(specs, names, results, baseline=baseline, options=options, capacity=cap)
    console().print(fragmentation_table(rows, names, baseline))
    argv = sys.argv[1:]
    if "fragmentation" in argv:  # the vmstoolkit command (or experiments/fragmentation.py): name it as typed
        command = "vmstoolkit experiment fragmentation " + shlex.join(argv[argv.index("fragmentation") + 1:])
    else:
        command = shlex.join(["python", sys.argv[0], *argv])
    with staged_dir(out) as stage:  # interrupted or failing: no partial file in --out
        written = write_outputs(stage, rows, results, allocators=names, timeline_workload=timeline, command=command,
                                machine=machine_description(), baseline=baseline,
                                replays=replay_rows(results, job_list))
    err = console(stderr=True)
    for p in written:
        err.print(f"wrote {out / p.name}", markup=False, highlight=False)
    if oom_exit_code and any(r.oom for r in results):
        raise typer.Exit(code=oom_exit_code)
