"""Sweep throughput: the bundled traces x allocators on local processes and on a local Dask cluster.

    python benchmarks/sweep_cluster.py [--workers 1 2 4] [--allocator NAME ...] [--out DIR]

Runs every (trace, allocator) replay job of the 8 bundled snapshots (caching and expandable
runs) x 4 allocators (default: pytorch-caching, pytorch-expandable, gmlake, vms) with the
local-process runner and with a Dask ``LocalCluster`` (``--cluster local:N``) of 1, 2 and 4
workers, and prints per (runner, workers): wall seconds (the cluster's start and shutdown
included: what a user waits for), jobs per second, speed-up over one local process, and
whether the results equal the one-process run's (every figure but the timings). With
``--out`` it writes ``results.json`` and ``README.md`` (command, machine, table) there.

Speed-ups are bounded by the machine's free cores; the first row of each runner includes its
start-up (worker processes import numpy, numba and vmstoolkit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vmstoolkit.analysis.fragmentation import DEFAULT_ALLOCATORS, plan_jobs, run_jobs
from vmstoolkit.trace.bundled import bundled_trace_paths

TIMING = ("seconds", "events_per_second")


def figures(results) -> str:
    return json.dumps([{k: v for k, v in r.as_dict().items() if k not in TIMING} for r in results],
                      sort_keys=True, default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--allocator", action="append", default=None)
    ap.add_argument("--out", type=Path, default=None, help="write results.json and README.md here")
    args = ap.parse_args(argv)
    specs = [str(p) for mode in ("caching", "expandable") for p in bundled_trace_paths(mode)]
    allocators = args.allocator or list(DEFAULT_ALLOCATORS)
    jobs = plan_jobs(specs, allocators, timeline_workload=None)
    load_before = os.getloadavg()[0]  # other work on the machine bounds the speed-ups
    reference = None
    rows = []
    for runner in ("local processes", "dask local cluster"):
        for n in args.workers:
            t0 = time.perf_counter()
            if runner == "local processes":
                results = run_jobs(jobs, n)
            else:
                results = run_jobs(jobs, cluster=f"local:{n}")
            wall = time.perf_counter() - t0
            fig = figures(results)
            if reference is None:
                reference = fig  # the first run: one local process (in this process)
            rows.append({"runner": runner, "workers": n, "jobs": len(jobs), "wall_s": round(wall, 2),
                         "jobs_per_s": round(len(jobs) / wall, 2),
                         "replay_s_sum": round(sum(r.seconds for r in results), 2),
                         "same_results": fig == reference})
    base = rows[0]["wall_s"]
    for r in rows:
        r["speedup_vs_1_local"] = round(base / r["wall_s"], 2)
    machine = (f"{platform.node() or 'unknown host'}: {platform.system()} {platform.machine()}, "
               f"{os.cpu_count()} cores, Python {platform.python_version()}")
    command = shlex.join(["python", "benchmarks/sweep_cluster.py", *(argv if argv is not None else sys.argv[1:])])
    t = Table(title=f"sweep: {len(specs)} bundled traces x {len(allocators)} allocators = {len(jobs)} jobs ({machine})")
    for c in ("runner", "workers", "wall s", "jobs / s", "speed-up", "sum of replay s", "same results"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["runner"], str(r["workers"]), f"{r['wall_s']:.2f}", f"{r['jobs_per_s']:.2f}",
                  f"{r['speedup_vs_1_local']:.2f}x", f"{r['replay_s_sum']:.1f}", "yes" if r["same_results"] else "NO")
    Console(width=160).print(t)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"command": command, "machine": machine, "load_average_1min_before": round(load_before, 2),
               "load_average_1min_after": round(os.getloadavg()[0], 2), "traces": [Path(s).name for s in specs],
               "allocators": allocators, "rows": rows}
        (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
        md = ["| runner | workers | wall s | jobs / s | speed-up vs 1 local process | sum of replay s | same results |",
              "|---|---|---|---|---|---|---|"]
        md += [f"| {r['runner']} | {r['workers']} | {r['wall_s']:.2f} | {r['jobs_per_s']:.2f} | "
               f"{r['speedup_vs_1_local']:.2f}x | {r['replay_s_sum']:.1f} | {'yes' if r['same_results'] else 'NO'} |"
               for r in rows]
        (args.out / "table.md").write_text("\n".join(md) + "\n")
    return 0 if all(r["same_results"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
