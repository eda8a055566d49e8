"""The ``paged`` allocator on the bundled traces: its memory and driver work beside ``vms`` and
PyTorch's modes, and what its two knobs (reclaim order, slack) trade.

    python experiments/paged_policy.py [--out experiments/results/paged] [--passes 5] [--traces SNAPSHOT ...] [--rows LABEL ...]

Each trace is replayed ``--passes`` times in a row on the simulated driver; steady state is
passes 3 and later. Per row: peak reserved, utilization, the modelled driver time per replay in
steady state (the H200 per-call costs, ``common.COST_US``), and the device
synchronizations per replay (``paged`` waits for queued work before it unmaps a page; ``vms``
before it destroys a range).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import grid, priced, replay_passes, sweep, write
from vmstoolkit.pools import make_allocator

ROWS = {
    "paged": ("paged", {}),
    "paged, reclaim batch 1": ("paged", {"reclaim_batch": 1}),
    "paged, reclaim batch 64": ("paged", {"reclaim_batch": 64}),
    "paged, clock reclaim": ("paged", {"reclaim": "clock"}),
    "paged, best-fit placement": ("paged", {"placement": "best-fit"}),
    "paged, aliases": ("paged", {"aliases": True}),
    "paged, aliases, slack 64": ("paged", {"aliases": True, "slack_pages": 64}),
    "paged, slack 64 pages": ("paged", {"slack_pages": 64}),
    "paged, slack 128 pages": ("paged", {"slack_pages": 128}),
    "paged, slack 256 pages": ("paged", {"slack_pages": 256}),
    "paged, 64 KiB units": ("paged", {"large_unit": 64 << 10}),
    "paged, 64 KiB units, slack 128": ("paged", {"large_unit": 64 << 10, "slack_pages": 128}),
    "paged, 64 KiB units, slack 256": ("paged", {"large_unit": 64 << 10, "slack_pages": 256}),
    "paged, 512 KiB units, slack 256": ("paged", {"large_unit": 512 << 10, "slack_pages": 256}),
    "paged, aliases, slack 16, 64 KiB units": ("paged", {"aliases": True, "slack_pages": 16, "large_unit": 64 << 10}),
    "paged, aliases, slack 32, 64 KiB units": ("paged", {"aliases": True, "slack_pages": 32, "large_unit": 64 << 10}),
    "paged, aliases, slack 48, 64 KiB units": ("paged", {"aliases": True, "slack_pages": 48, "large_unit": 64 << 10}),
    "paged, aliases, slack 64, 64 KiB units": ("paged", {"aliases": True, "slack_pages": 64, "large_unit": 64 << 10}),
    "paged, aliases, slack 64, 512 KiB units": ("paged", {"aliases": True, "slack_pages": 64, "large_unit": 512 << 10}),
    "vms": ("vms", {}),
    "pytorch-expandable": ("pytorch-expandable", {}),
    "pytorch-caching": ("pytorch-caching", {}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--traces", type=Path, nargs="+", default=None,
                    help="snapshots to replay instead of the bundled traces (e.g. train_llama_gpu.py --snapshots)")
    ap.add_argument("--rows", nargs="+", choices=sorted(ROWS), metavar="LABEL", help="only these rows (default: all)")
    args = ap.parse_args()
    rows_wanted = {k: ROWS[k] for k in args.rows} if args.rows else ROWS

    def run(trace, label):
        name, options = ROWS[label]
        return priced(replay_passes(trace, lambda d: make_allocator(name, d, **options), args.passes))

    rows = sweep(rows_wanted, run, "row", lambda r: f"peak {r['peak_reserved'] / 2**30:6.2f} GiB  util {r['utilization']:.3f}  "
                 f"driver {r['steady_driver_ms']:6.1f} ms  syncs {r['steady_syncs']:5.0f} per replay", args.traces)
    write(args.out, "paged_policy", rows, grid(rows, "row", lambda r: f"{r['peak_reserved'] / 2**30:.2f} GiB / "
                                                f"{r['steady_driver_ms']:.0f} ms / {r['steady_syncs']:.0f}", "allocator"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
