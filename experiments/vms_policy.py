"""Why ``vms`` is tuned the way it is: a sweep of stitch-policy knobs on the bundled traces.

    python experiments/vms_policy.py [--out experiments/results/vms_policy]

For each policy: utilization (peak allocated / peak reserved) over the whole replay, and the
driver work of steady state, priced with the per-call costs
measured on the H200 (``experiments/results/h200/gpu_pools.json``: cuMemCreate 16 us, cuMemMap
2.9 us, cuMemSetAccess 25 us per chunk of a new mapping, cuMemUnmap ~3 us, address reserve/free
~5 us). The price is a model, not a measurement: it says where driver time goes.

Steady state: each trace (six training steps of varying batch and sequence length) is replayed
``PASSES`` times in a row, as a training run meets the same shapes again (what
``experiments/train_llama_gpu.py`` does in its later rounds); the driver work per pass is
averaged over passes 3 to ``PASSES`` (the first two warm the pools up), and the last pass's is
kept too, to show whether it settles or keeps growing. Allocations still live at the end of a
pass are freed before the next.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.vmm.allocator import VMMAllocator
from vmstoolkit.units import MiB

from sweep import grid, sweep, write

COST_US = {"create": 16.0, "map": 2.9, "unmap": 3.0, "release": 5.0, "reserve": 5.0, "free_address": 5.0}
SET_ACCESS_US_PER_CHUNK = 25.0

PASSES = 8
WARM_PASSES = 2

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


class _AccessMeter:
    """Counts chunks given access rights, by wrapping the driver's set_access."""

    def __init__(self, driver) -> None:
        self.chunks = 0
        inner = driver._set_access

        def counted(va, size, _inner=inner):
            self.chunks += size // driver.granularity
            _inner(va, size)

        driver._set_access = counted


def run(name: str, options: dict, trace, passes: int = PASSES) -> dict:
    a: VMMAllocator = make_allocator(name, **options)
    meter = _AccessMeter(a.driver)
    events = trace.alloc_free_events()
    per_pass_us = []
    calls_total: dict = {}
    paths_total: dict = {}
    for i in range(passes):
        before = (dict(a.driver.calls), meter.chunks, dict(a.counts))
        addr = {}
        for e in events:
            if e.action.value == "alloc":
                addr[e.addr] = a.allocate(e.size, e.stream)
            else:
                p = addr.pop(e.addr, None)
                if p is not None:
                    a.free(p)
        for p in addr.values():
            a.free(p)
        calls = {k: v - before[0].get(k, 0) for k, v in a.driver.calls.items()}
        chunks = meter.chunks - before[1]
        per_pass_us.append(sum(COST_US.get(k, 0.0) * v for k, v in calls.items()) + SET_ACCESS_US_PER_CHUNK * chunks)
        if i >= WARM_PASSES:
            for k, v in calls.items():
                calls_total[k] = calls_total.get(k, 0) + v
            for k, v in a.counts.items():
                paths_total[k] = paths_total.get(k, 0) + v - before[2].get(k, 0)
    s = a.stats()
    a.close()
    steady = per_pass_us[WARM_PASSES:]
    return {"utilization": s.utilization, "peak_reserved": s.peak_reserved_bytes,
            "steady_driver_ms": sum(steady) / len(steady) / 1000, "last_pass_driver_ms": steady[-1] / 1000,
            "per_pass_driver_ms": [u / 1000 for u in per_pass_us], "steady_calls": calls_total,
            "steady_paths": paths_total, "events_per_pass": len(events), "passes": passes}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = sweep(POLICIES, lambda trace, label: run(*POLICIES[label], trace), "policy",
                 lambda r: f"util={r['utilization']:.4f} steady driver {r['steady_driver_ms']:8.1f} ms  paths {r['steady_paths']}")
    write(args.out, "vms_policy", rows, markdown_table(rows))
    return 0


def markdown_table(rows: list[dict]) -> str:
    """Policies by trace: ``utilization / mean steady-state driver ms per pass (last pass)``."""
    return grid(rows, "policy", lambda r: f"{r['utilization']:.4f} / {r['steady_driver_ms']:.0f} ms ({r['last_pass_driver_ms']:.0f})",
                "policy")


if __name__ == "__main__":
    raise SystemExit(main())
