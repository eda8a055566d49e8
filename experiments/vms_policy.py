"""Why ``vms`` is tuned the way it is: a sweep of stitch-policy knobs on the bundled traces.

    python experiments/vms_policy.py [--out experiments/results/vms_policy] [--passes 8] [--traces SNAPSHOT ...]

For each policy: utilization (peak allocated / peak reserved) over the whole replay, and the
driver work of steady state, priced with the per-call costs measured on the H200
(``common.COST_US``: cuMemCreate 16 us, cuMemMap 2.9 us, cuMemSetAccess 25 us per chunk of a new
mapping, cuMemUnmap ~3 us, address reserve/free ~5 us). The price is a model, not a
measurement: it says where driver time goes.

Steady state: each trace (six training steps of varying batch and sequence length) is replayed
``--passes`` times in a row, as a training run meets the same shapes again (what
``experiments/train_llama_gpu.py`` does in its later rounds); the driver work per pass is
averaged over passes 3 to ``--passes`` (the first two warm the pools up), and the last pass's is
kept too, to show whether it settles or keeps growing. Allocations still live at the end of a
pass are freed before the next.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import grid, replay_passes, steady, sweep, write
from vmstoolkit.pools import make_allocator
from vmstoolkit.units import MiB

PASSES = 8

POLICIES = {
    "gmlake (defaults)": ("gmlake", {}),
    "vms": ("vms", {}),
    "vms, no coalescing": ("vms", {"coalesce": False}),
    "vms, no prefix reuse": ("vms", {"stitched_prefix": False}),
    "vms, no prefix, reuse <= 2x": ("vms", {"stitched_prefix": False, "reuse_max_ratio": 2.0}),
    "vms, no prefix, reuse <= 10x": ("vms", {"stitched_prefix": False, "reuse_max_ratio": 10.0}),
    "vms, largest-first": ("vms", {"selection": "largest-first"}),
    "vms, cache 128": ("vms", {"max_cached_stitched": 128}),
    "vms, cache 1024": ("vms", {"max_cached_stitched": 1024}),
    "vms, stitch >= 64 MiB": ("vms", {"stitch_min_bytes": 64 * MiB}),
}


def run(name: str, options: dict, trace, passes: int = PASSES) -> dict:
    r = replay_passes(trace, lambda d: make_allocator(name, d, **options), passes, counters=lambda a: a.counts)
    warm = steady(r["per_pass"])
    total = {}
    for key, part in (("calls", "steady_calls"), ("counters", "steady_paths")):
        total[part] = {}
        for p in warm:
            for k, v in p[key].items():
                total[part][k] = total[part].get(k, 0) + v
    return {"utilization": r["utilization"], "peak_reserved": r["peak_reserved"],
            "steady_driver_ms": sum(p["us"] for p in warm) / len(warm) / 1000, "last_pass_driver_ms": warm[-1]["us"] / 1000,
            "per_pass_driver_ms": [p["us"] / 1000 for p in r["per_pass"]], **total,
            "events_per_pass": r["events_per_pass"], "passes": passes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--passes", type=int, default=PASSES)
    ap.add_argument("--traces", type=Path, nargs="+", default=None, help="snapshots instead of the bundled traces")
    args = ap.parse_args()
    rows = sweep(POLICIES, lambda trace, label: run(*POLICIES[label], trace, args.passes), "policy",
                 lambda r: f"util={r['utilization']:.4f} steady driver {r['steady_driver_ms']:8.1f} ms  paths {r['steady_paths']}",
                 args.traces)
    write(args.out, "vms_policy", rows, markdown_table(rows))
    return 0


def markdown_table(rows: list[dict]) -> str:
    """Policies by trace: ``utilization / mean steady-state driver ms per pass (last pass)``."""
    return grid(rows, "policy", lambda r: f"{r['utilization']:.4f} / {r['steady_driver_ms']:.0f} ms ({r['last_pass_driver_ms']:.0f})",
                "policy")


if __name__ == "__main__":
    raise SystemExit(main())
