"""Replay speed: events per second of every allocator on the bundled traces, side by side.

    python benchmarks/replay_speed.py [--repeat 3] [--allocator vms ...] [--mode caching --mode expandable]
                                      [--synthetic full:200] [--trace PATH ...] [--json]
                                      [--generated 100000,500000,2000000 [--generated-allocators paged,vms]]

One run measures, on each bundled trace (both recording modes by default) and on long synthetic
traces (``--synthetic KIND:STEPS``, steady state: the driver's work is done in the first steps):

- every allocator through the Python replay (``replay(..., compiled=False)``) on the compiled
  simulated driver (``make_driver("sim")``), and its ratio to ``pytorch-caching`` measured in
  the same run;
- ``--reference-driver NAME`` (default ``vms``): that allocator once more on the Python
  reference driver (``make_driver("sim-reference")``), so the compiled driver's gain is
  measured side by side (the results are the same: ``tests/pools/drivers/test_compiled_driver.py``);
- ``paged (compiled)``: the same replay through ``paged``'s compiled path
  (:meth:`~vmstoolkit.pools.base.Allocator.compiled_replay`), whose results are the same to the
  byte (``tests/pools/paged/test_paged_replay.py``); ``loop ev/s`` is events over the time spent in
  compiled code alone (on the compiled simulated driver that includes mapping the pages:
  ``pools/paged/driver_work.py``; the rest is the Python steps the loop returns for: stream
  ordering, new streams, growing the heap's records, and the set-up and hand-back).

- ``--generated SIZES``: snapshots of that many entries, 5 frames each, generated at run time
  into a temporary folder (``loader_bench.generate``, never shipped), each loaded and replayed
  in its own subprocess per allocator of ``--generated-allocators`` (so peak RSS is its own):
  load + replay time against ``pickle.load`` of the same file, peak RSS, events/s against
  ``pytorch-caching``'s (``loader_bench.print_replays``, the same table loader_bench prints).

Each figure is the best of ``--repeat`` runs, on a fresh allocator and simulated driver (the
driver simulation costs about as much as the allocators' own Python: quote ratios, not absolute
figures, unless they come from the same machine). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numba
from rich.console import Console
from rich.table import Table

from vmstoolkit.pools import allocator_names, make_allocator, make_driver
from vmstoolkit.trace import bundled_trace_paths, load_trace, replay
from vmstoolkit.trace.replay import event_arrays
from vmstoolkit.trace.synthetic import synthetic_trace

BASE = "pytorch-caching"
COMPILED = "paged (compiled)"
REFERENCE = " (reference driver)"


def _best(trace, name: str, repeat: int, compiled: bool, driver: str = "sim") -> dict:
    best = None
    for _ in range(repeat):
        a = make_allocator(name, make_driver(driver))
        r = replay(trace, a, compiled=compiled)
        a.close()
        if best is None or r.seconds < best.seconds:
            best = r
    return {"events": best.events, "events_per_second": best.events_per_second,
            "driver_calls": sum(best.driver_calls.values()), "peak_reserved": best.peak_reserved}


def _loop_rate(trace, repeat: int) -> float:
    """Events per second of the compiled loop alone (time outside the driver's Python work)."""
    best = 0.0
    events = trace.alloc_free_events()
    for _ in range(repeat):
        a = make_allocator("paged")
        run = a.compiled_replay(event_arrays(events))
        a.close()
        best = max(best, run.done / run.loop_seconds)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--allocator", action="append", default=None)
    ap.add_argument("--mode", action="append", default=None, help="bundled recording mode (caching, expandable)")
    ap.add_argument("--synthetic", action="append", default=None, help="KIND:STEPS of a synthetic trace")
    ap.add_argument("--trace", action="append", default=None, metavar="PATH",
                    help="a snapshot of your own (repeatable); with --trace, only --mode/--synthetic given "
                         "explicitly add the bundled and synthetic traces")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    ap.add_argument("--reference-driver", action="append", default=None, metavar="NAME",
                    help="also replay NAME on the Python reference driver (default: vms; 'none': no such rows)")
    ap.add_argument("--generated", default="", metavar="SIZES",
                    help="comma-separated entry counts of generated snapshots, each replayed in subprocesses")
    ap.add_argument("--generated-allocators", default="paged", metavar="NAMES",
                    help=f"allocators replayed on the generated snapshots ({BASE} is always added)")
    args = ap.parse_args(argv)
    names = args.allocator or allocator_names()
    if BASE not in names:
        names = [BASE, *names]
    defaults = not args.trace  # with your own traces, the bundled and synthetic ones only when asked for
    modes = args.mode if args.mode is not None else ["caching", "expandable"] if defaults else []
    traces = [load_trace(p) for m in modes for p in bundled_trace_paths(m)] + [load_trace(p) for p in args.trace or []]
    for spec in args.synthetic if args.synthetic is not None else ["full:100", "lora:100"] if defaults else []:
        kind, steps = spec.split(":")
        traces.append(synthetic_trace(kind, seed=0, steps=int(steps)))
    warm = make_allocator("paged")  # compile (or load from Numba's cache) before timing
    warm.compiled_replay(event_arrays(traces[0].alloc_free_events()[:1000]))
    rows = []
    t_start = time.perf_counter()
    for trace in traces:
        group = []
        for name in names:
            group.append({"trace": trace.name, "allocator": name, **_best(trace, name, args.repeat, False)})
        for name in args.reference_driver or ["vms"]:
            if name != "none":
                group.append({"trace": trace.name, "allocator": name + REFERENCE,
                              **_best(trace, name, args.repeat, False, "sim-reference")})
        if "paged" in names:
            group.append({"trace": trace.name, "allocator": COMPILED, **_best(trace, "paged", args.repeat, True),
                          "loop_events_per_second": _loop_rate(trace, args.repeat)})
        base = next(r["events_per_second"] for r in group if r["allocator"] == BASE)
        for r in group:
            r["vs_caching"] = r["events_per_second"] / base
        rows += group
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
               f"{sys.version.split()[0]}, Numba {numba.__version__}, compiled simulated driver unless marked")
    if args.json:
        for r in rows:
            print(json.dumps({**r, "machine": machine}))
        return 0
    t = Table(title=f"Replay speed (best of {args.repeat}; {machine}; {time.perf_counter() - t_start:.0f} s)")
    for col in ("trace", "allocator", "events", "events/s", "vs caching", "loop ev/s", "driver calls"):
        t.add_column(col, justify="left" if col in ("trace", "allocator") else "right")
    for r in rows:
        loop = r.get("loop_events_per_second")
        t.add_row(r["trace"], r["allocator"], str(r["events"]), f"{r['events_per_second']:,.0f}",
                  f"{r['vs_caching']:.2f}", f"{loop:,.0f}" if loop else "", f"{r['driver_calls']:,}")
    Console(width=130).print(t)
    summary = {}
    for r in rows:
        summary.setdefault(r["allocator"], []).append(r["vs_caching"])
    print("lowest ratio to pytorch-caching over the traces: " +
          ", ".join(f"{k} {min(v):.2f}" for k, v in summary.items() if k != BASE))
    if args.generated:
        generated(args.generated, args.generated_allocators)
    return 0


def generated(sizes: str, allocators: str) -> None:
    """Load + replay of generated snapshots, in subprocesses (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import loader_bench as lb

    names = [a for a in allocators.split(",") if a]
    if BASE not in names:
        names.append(BASE)
    replays = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in sizes.split(",")):
            p = Path(tmp) / f"gen-{n}.pickle"
            lb.generate(n, p)
            replays.append((n, lb.measure("pickle", p), {a: lb.measure(f"replay:{a}", p) for a in names}))
            p.unlink()
    lb.print_replays(replays)


if __name__ == "__main__":
    raise SystemExit(main())
