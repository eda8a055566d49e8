"""The pools on a real GPU: aliasing proof, invariants under random programs, and real replay.

    python experiments/gpu_pools.py --out DIR [--traces vmstoolkit/data/traces]

1. Stitching on the hardware: write a pattern through two primitive blocks, read it back
   through the stitched range that maps their chunks (and the reverse).
2. A seeded random allocate/free program on ``CudaDriver`` for each allocator, touching every
   allocation (cuMemsetD8) and checking the pool invariants after every operation.
3. Each bundled trace replayed through ``vms`` (and the baselines) on the real driver with
   ``touch``: peak reserved as the allocator counts it, physical memory in use as the device
   reports it (cuMemGetInfo at each new peak, above the baseline), and the simulated replay's
   peak reserved, side by side; plus driver-call timings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.trace import bundled_trace_paths, load_trace, replay
from vmstoolkit.units import MiB

DRIVER = "cuda"  # --driver sim: a CPU dry run of everything but the aliasing proof


def aliasing_proof(out: dict) -> None:
    from cuda.bindings import driver as cu

    d = make_driver(DRIVER)
    a = make_allocator("vms", d)
    g = d.granularity
    x, sep, y = a.allocate(3 * g), a.allocate(2 * g), a.allocate(2 * g)
    hx = np.arange(3 * g // 4, dtype=np.uint32)
    hy = np.arange(2 * g // 4, dtype=np.uint32) + 10**8
    cu.cuMemcpyHtoD(x, hx, hx.nbytes)
    cu.cuMemcpyHtoD(y, hy, hy.nbytes)
    a.free(x)
    a.free(y)
    s = a.allocate(5 * g)  # stitched from x's and y's chunks
    assert a.counts["stitch"] == 1, a.counts
    back = np.empty(5 * g // 4, dtype=np.uint32)
    cu.cuMemcpyDtoH(back, s, back.nbytes)
    parts = a._blocks[s].parts
    order = [p.va for p in parts]
    expect = np.concatenate([hx if va == x else hy for va in order])
    same_through_stitch = bool((back == expect).all())
    # write through the stitched range, read through the primitive range
    cu.cuMemsetD8(s, 7, 5 * g)
    one = np.empty(4, dtype=np.uint8)
    cu.cuMemcpyDtoH(one, x, 4)
    d.synchronize()
    out["aliasing"] = {"read_through_stitched_equals_written_through_primitives": same_through_stitch,
                       "write_through_stitched_seen_through_primitive": bool((one == 7).all())}
    a.free(s)
    a.free(sep)
    a.close()
    d.close()


def random_program(out: dict, name: str, steps: int = 600, seed: int = 0) -> None:
    rng = random.Random(seed)
    d = make_driver(DRIVER)
    a = make_allocator(name, d)
    live = []
    t0 = time.perf_counter()
    for _ in range(steps):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, MiB), rng.randint(MiB + 1, 64 * MiB), rng.randint(64 * MiB, 512 * MiB)])
            p = a.allocate(size)
            d.memset(p, size)
            live.append(p)
        a._check()
    d.synchronize()
    a.close()
    out.setdefault("random_programs", {})[name] = {
        "steps": steps, "seconds": time.perf_counter() - t0, "driver_calls": dict(d.calls),
        "physical_bytes_after_close": d.physical_bytes}
    d.close()


def real_replays(out: dict, allocators: list[str], paths: list[Path]) -> None:
    rows = []
    for path in paths:
        trace = load_trace(path)
        for name in allocators:
            sim = make_allocator(name)
            rs = replay(trace, sim)
            sim.close()
            d = make_driver(DRIVER)
            a = make_allocator(name, d)
            r = replay(trace, a, touch=True)
            d.synchronize()
            a.close()
            extra = d.replay_extra() or {"device_used_at_peak": d.peak_physical_bytes, "device": "sim"}
            d.close()
            row = {"trace": trace.name, "allocator": name, "events": r.events,
                   "peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                   "sim_peak_reserved": rs.peak_reserved, "device_used_at_peak": extra["device_used_at_peak"],
                   "device_vs_sim": extra["device_used_at_peak"] / rs.peak_reserved - 1,
                   "utilization": r.utilization, "seconds": r.seconds, "sim_seconds": rs.seconds,
                   "driver_calls": r.driver_calls, "device": extra["device"]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "driver_calls"}), flush=True)
    out["replays"] = rows


def op_timings(out: dict, n: int = 256) -> None:
    d = make_driver(DRIVER)
    g = d.granularity
    t = {}
    t0 = time.perf_counter()
    hs = [d.create(g) for _ in range(n)]
    t["create_us"] = (time.perf_counter() - t0) / n * 1e6
    va = d.reserve(n * g)
    t0 = time.perf_counter()
    for i, h in enumerate(hs):
        d.map(va + i * g, g, h)
    t["map_us"] = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    d.set_access(va, n * g)
    t["set_access_per_chunk_us"] = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n):
        d.set_access(va + i * g, g)
    t["set_access_single_chunk_call_us"] = (time.perf_counter() - t0) / n * 1e6
    for i, h in enumerate(hs):
        d.unmap(va + i * g, g)
        d.release(h)
    d.free_address(va, n * g)
    t0 = time.perf_counter()
    ptrs = [d.mem_alloc(20 * MiB) for _ in range(64)]
    t["mem_alloc_20MiB_us"] = (time.perf_counter() - t0) / 64 * 1e6
    for p in ptrs:
        d.mem_free(p)
    d.close()
    out["op_timings"] = t
    print(json.dumps(t), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--allocator", action="append", default=None)
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--driver", default="cuda", choices=["cuda", "sim"])
    args = ap.parse_args()
    global DRIVER
    DRIVER = args.driver
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict = {"command": " ".join(sys.argv)}
    op_timings(out)
    if DRIVER == "cuda":
        aliasing_proof(out)
        print(json.dumps(out["aliasing"]), flush=True)
    for name in ("vms", "gmlake", "native", "pytorch-caching", "pytorch-expandable"):
        random_program(out, name)
    print(json.dumps(out["random_programs"]), flush=True)
    if not args.skip_replay:
        real_replays(out, args.allocator or ["vms", "gmlake", "pytorch-caching", "pytorch-expandable"], bundled_trace_paths())
    (args.out / "gpu_pools.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
