"""Does the physical layout behind a virtual range change how fast kernels run on it?

    python experiments/layout_bench.py [--gib 8] [--out DIR]

The ``paged`` allocator maps 2 MiB chunks wherever blocks need them, so after a few reclaims the
chunks behind a large block are in no particular physical order; ``expandable_segments`` maps
20 MiB handles in order, and ``cudaMalloc`` hands out large physically contiguous segments. This
times the same kernels on one buffer of ``--gib`` GiB laid out five ways: ``cudaMalloc``; one
VMM handle; 2 MiB chunks mapped in the order they were created; the same chunks in a random
order; and runs of 16 chunks (32 MiB) in order, the runs shuffled. Kernels: a random gather
(2^24 floats from anywhere in the buffer: every access may miss the GPU's TLB), a full sum
(streaming), and a gather confined to a 1 GiB window. Medians of 20 timed repetitions (CUDA
events). Needs a GPU and torch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from common import time_events
from vmstoolkit.pools.drivers.cuda import CudaDriver
from vmstoolkit.units import GiB


class _Cai:
    """A device buffer for ``torch.as_tensor`` (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "strides": None}


def time_kernels(torch, x) -> dict:
    n = x.numel()
    g = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randint(0, n, (1 << 24,), device="cuda", generator=g)
    narrow = torch.randint(0, min(n, GiB // 4), (1 << 24,), device="cuda", generator=g)
    kernels = {"gather_anywhere": lambda: x[wide].sum(), "sum_stream": lambda: x.sum(),
               "gather_1gib_window": lambda: x[narrow].sum()}
    return {name + "_ms": time_events(fn, 20, warmup=1) for name, fn in kernels.items()}


def vmm_layout(torch, d: CudaDriver, nbytes: int, how: str) -> dict:
    page = d.granularity
    n = nbytes // page
    va = d.reserve(nbytes)
    if how == "one handle":
        handles = [d.create(nbytes)]
        d.map(va, nbytes, handles[0])
    else:
        handles = [d.create(page) for _ in range(n)]
        order = list(range(n))
        rng = random.Random(0)
        if how == "2 MiB chunks, shuffled":
            rng.shuffle(order)
        elif how == "32 MiB runs, shuffled":
            runs = [order[i:i + 16] for i in range(0, n, 16)]
            rng.shuffle(runs)
            order = [c for r in runs for c in r]
        for i, c in enumerate(order):
            d.map(va + i * page, page, handles[c])
    d.set_access(va, nbytes)
    x = torch.as_tensor(_Cai(va, nbytes), device="cuda")
    x.fill_(1.0)
    r = time_kernels(torch, x)
    del x
    torch.cuda.synchronize()
    if how == "one handle":
        d.unmap(va, nbytes)
    else:
        for i in range(n):
            d.unmap(va + i * page, page)
    for h in handles:
        d.release(h)
    d.free_address(va, nbytes)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    nbytes = args.gib * GiB
    torch.cuda.init()
    d = CudaDriver(0)
    rows = []
    x = torch.ones(nbytes // 4, device="cuda")
    rows.append({"layout": "cudaMalloc", **time_kernels(torch, x)})
    del x
    torch.cuda.empty_cache()
    for how in ("one handle", "2 MiB chunks, in order", "2 MiB chunks, shuffled", "32 MiB runs, shuffled"):
        rows.append({"layout": how, **vmm_layout(torch, d, nbytes, how)})
    d.close()
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layout_bench.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "gib": args.gib, "page_MiB": 2,
             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
