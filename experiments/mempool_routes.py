"""Memory of the two routes into PyTorch on the four LLaMA training traces: vmstoolkit installed
as PyTorch's allocator (``vt.install``) against a ``torch.cuda.MemPool`` backed by it (``vt.use_pool``).

    python experiments/mempool_routes.py [--out experiments/results/mempool-routes]
        [--global pytorch-caching,pytorch-expandable,paged,vms] [--pool paged,vms]
        [--capacity SIZE | --headroom FRACTION] [--traces SNAPSHOT ...]

Every trace (the bundled ``*.caching`` snapshots by default) is replayed once on the simulated
driver through each row:

- ``global NAME``: the allocator serves every request itself, as after ``vt.install(NAME)``
  (``pytorch-caching`` and ``pytorch-expandable`` are PyTorch's own two modes);
- ``mempool NAME``: the MemPool route. PyTorch's caching allocator serves every request and asks
  ``NAME`` only for whole segments, which it splits and caches itself
  (:class:`~vmstoolkit.pools.baselines.pytorch_caching.PyTorchCachingAllocator` over
  :class:`~vmstoolkit.pools.baselines.pytorch_caching.AllocatorSegments`): 2 MiB segments for
  requests up to 1 MiB, 20 MiB for those under 10 MiB, larger ones rounded up to 2 MiB; expandable
  segments off; a cached segment goes back to ``NAME`` only through ``max_split_size``'s retry
  (PyTorch keeps a live pool's cached blocks through its last retry and ``empty_cache``).

The device has an H200's 141 GiB unless ``--capacity`` says otherwise, or ``--headroom h`` makes
it each trace's peak allocated times ``1 + h`` (rounded up to 2 MiB): memory pressure, where the
routes part ways (PyTorch's own allocator frees its cached segments and retries; a MemPool
keeps them). Each row prints peak reserved (physical memory on the device), peak allocated (bytes the program
asked for) and utilization (their ratio); the MemPool rows also the segments ``NAME`` gave.
``--global`` and ``--pool`` take the library's allocator syntax (``paged:aliases=true,slack_pages=64``),
joined by ``;`` when options have commas. The traces hold every allocation of the run, so the
MemPool rows model a program whose every allocation goes to the pool; under ``with vt.use_pool(...)``
the backward pass's allocations (autograd's thread) go to PyTorch's own pools instead (the traces
do not record threads). Writes ``mempool_routes.json`` (the command and every row),
``mempool_routes.csv`` and ``mempool_routes.md`` (the table) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from vmstoolkit.analysis.rows import replay_row, rows_to_csv
from vmstoolkit.errors import VmsError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.baselines.pytorch_caching import AllocatorSegments, PyTorchCachingAllocator
from vmstoolkit.pools.drivers import make_driver
from vmstoolkit.pools.registry import parse_allocator_spec
from vmstoolkit.trace import bundled_trace_paths, load_trace
from vmstoolkit.trace.replay import replay
from vmstoolkit.units import parse_size

GiB = 1 << 30


def specs(text: str) -> list:
    """``"paged,vms"`` or ``"paged:aliases=true,slack_pages=64;vms"`` -> checked allocator specs."""
    items = text.split(";") if ";" in text else text.split(",")
    return [parse_allocator_spec(t) for t in items if t.strip()]


def peak_requested(trace) -> int:
    """The most bytes the trace's program held at once (memory live before recording included).
    Runtime complexity: O(events)."""
    live: dict[int, int] = {e.addr: e.size for e in trace.preexisting}
    now = peak = sum(live.values())
    for e in trace.alloc_free_events():
        if e.action.value == "alloc":
            live[e.addr] = e.size
            now += e.size
            peak = max(peak, now)
        else:
            now -= live.pop(e.addr, 0)
    return peak


def run_row(trace, route: str, spec, capacity: int | None) -> dict:
    """One replay of ``trace`` through ``spec`` by ``route`` (``global`` or ``mempool``): its flat row."""
    driver = make_driver("sim", capacity=capacity)
    if route == "global":
        target = make_allocator(spec.name, driver, **spec.options)
    else:
        target = PyTorchCachingAllocator(driver, segments=lambda d: AllocatorSegments(make_allocator(spec.name, d, **spec.options)))
    try:
        result = replay(trace, target)
        row = replay_row(result, capacity=capacity, options=spec.options)
        row.update(route=route, label=f"{route} {spec}", events_total=len(trace.alloc_free_events()))
        if route == "mempool":
            up = target.segment_source.upstream.stats()
            row.update(segments=target.num_device_alloc, segments_given_back=target.num_device_free,
                       peak_segment_bytes=up.peak_allocated_bytes, upstream=spec.name)
    finally:
        target.close()
    return row


def table(rows: list[dict]) -> str:
    """Markdown: per trace, each row's peak reserved (utilization), and what the MemPool route
    costs against the same allocator installed globally."""
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["trace"], r["label"]): r for r in rows}
    lines = ["| row | " + " | ".join(traces) + " |", "|---|" + "---|" * len(traces)]
    peak = {t: max(r["peak_allocated"] for r in rows if r["trace"] == t) for t in traces}  # an OOM row stops early
    lines.append("| peak allocated | " + " | ".join(f"{peak[t] / GiB:.2f} GiB" for t in traces) + " |")
    if any(by[(t, labels[0])]["capacity"] is not None for t in traces):
        lines.append("| device memory | " + " | ".join(f"{(by[(t, labels[0])]['capacity'] or 0) / GiB:.2f} GiB" for t in traces) + " |")
    for lab in labels:
        cells = []
        for t in traces:
            r = by[(t, lab)]
            cell = (f"OOM at event {r['oom_event']} of {r['events_total']}" if r["oom"]
                    else f"{r['peak_reserved'] / GiB:.2f} GiB ({r['utilization']:.1%})")
            same = by.get((t, lab.replace("mempool", "global", 1)))
            if r["route"] == "mempool" and same is not None and not (r["oom"] or same["oom"]):
                cell += f", {(r['peak_reserved'] - same['peak_reserved']) / GiB:+.2f} GiB vs global"
            cells.append(cell)
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commit() -> str:
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent)
        return p.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON, CSV and Markdown table")
    ap.add_argument("--global", dest="globals_", default="pytorch-caching,pytorch-expandable,paged,vms",
                    help="allocators installed globally (the library's NAME:KEY=VALUE syntax; ';' between them when options have commas)")
    ap.add_argument("--pool", default="paged,vms", help="allocators behind a MemPool (PyTorch's caching allocator on top)")
    room = ap.add_mutually_exclusive_group()
    room.add_argument("--capacity", default=None, help="device memory of the simulated driver (default: an H200's 141 GiB)")
    room.add_argument("--headroom", type=float, default=None,
                      help="device memory = each trace's peak allocated x (1 + FRACTION), rounded up to 2 MiB")
    ap.add_argument("--traces", type=Path, nargs="+", default=None, help="snapshots instead of the four bundled LLaMA traces")
    args = ap.parse_args()
    try:
        rows_spec = [("global", s) for s in specs(args.globals_)] + [("mempool", s) for s in specs(args.pool)]
        capacity = parse_size(args.capacity) if args.capacity is not None else None
    except VmsError as e:
        ap.error(str(e))
    if args.headroom is not None and not args.headroom >= 0:
        ap.error(f"--headroom must be a fraction >= 0, got {args.headroom}")
    if not rows_spec:
        ap.error("no rows: give --global or --pool allocators")
    rows = []
    for path in args.traces or bundled_trace_paths():
        trace = load_trace(path)
        if args.headroom is not None:
            capacity = -(-int(peak_requested(trace) * (1 + args.headroom)) // (2 << 20)) * (2 << 20)
        for route, spec in rows_spec:
            row = run_row(trace, route, spec, capacity)
            row["trace"] = trace.name.split(".")[0]
            rows.append(row)
            extra = f"  segments {row['segments']}" if route == "mempool" else ""
            state = f"OOM at event {row['oom_event']}" if row["oom"] else f"{row['peak_reserved'] / GiB:6.2f} GiB"
            print(f"{row['trace']:14s} {row['label']:34s} reserved {state}  allocated {row['peak_allocated'] / GiB:6.2f} GiB"
                  f"  util {row['utilization']:.3f}{extra}", flush=True)
    md = table(rows)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": shlex.join(["python", *sys.argv]), "commit": commit(), "machine": platform.platform(),
                "python": platform.python_version(), "driver": "simulated"}
        (args.out / "mempool_routes.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        (args.out / "mempool_routes.csv").write_text(rows_to_csv(rows))
        (args.out / "mempool_routes.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
