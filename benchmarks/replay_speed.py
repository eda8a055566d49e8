"""Replay speed: events per second of every allocator on the bundled traces, side by side.

    python benchmarks/replay_speed.py [--repeat 3] [--allocator vms ...]

Prints one row per (trace, allocator), the best of ``--repeat`` runs, and the ratio of each
allocator's speed to ``native`` measured in the same run. Figures are machine-dependent: quote
the ratios, not the absolute numbers, unless they come from the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from rich.console import Console
from rich.table import Table

from vmstoolkit.pools import allocator_names, make_allocator
from vmstoolkit.trace import bundled_trace_paths, load_trace, replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--allocator", action="append", default=None)
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(argv)
    names = args.allocator or allocator_names()
    rows = []
    for path in bundled_trace_paths():
        trace = load_trace(path)
        speeds = {}
        for name in names:
            best = None
            for _ in range(args.repeat):
                a = make_allocator(name)
                r = replay(trace, a)
                a.close()
                if best is None or r.seconds < best.seconds:
                    best = r
            speeds[name] = best.events_per_second
            rows.append({"trace": trace.name, "allocator": name, "events": best.events,
                         "events_per_second": round(best.events_per_second),
                         "driver_calls": sum(best.driver_calls.values())})
        for row in rows[-len(names):]:
            base = speeds.get("native")
            row["vs_native"] = round(row["events_per_second"] / base, 3) if base else None
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    t = Table(title=f"Replay speed (best of {args.repeat}; {platform.processor() or platform.machine()}, Python {sys.version.split()[0]})")
    for col in ("trace", "allocator", "events", "events/s", "vs native", "driver calls"):
        t.add_column(col, justify="left" if col in ("trace", "allocator") else "right")
    for r in rows:
        t.add_row(r["trace"], r["allocator"], str(r["events"]), f"{r['events_per_second']:,}",
                  f"{r['vs_native']:.2f}" if r["vs_native"] else "-", f"{r['driver_calls']:,}")
    Console(width=120).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
