"""What a PyTorch allocator callback costs when PyTorch calls it from its own threads.

PyTorch's autograd engine frees and allocates from a native device thread. Each row calls the
allocator entry points ``n`` times (one alloc and one free per round trip), side by side in one
run, from a fresh native thread (a Numba cfunc started with pthread_create) unless it says
"Python thread":

- ``empty callbacks``: ctypes callbacks that return at once: the bare ctypes crossing;
- ``vms handle, no pins``: the PyTorch integration's callbacks with thread-state pinning off;
- ``vms handle``: as shipped (``ThreadStatePins``);
- ``vms handle, Python thread``: the same callbacks called through ctypes from this thread;
- ``paged hook (compiled)``: the ``paged`` allocator's Numba ``cfunc`` entry points
  (:mod:`vmstoolkit.integrations.native_torch`), warm: no Python at all.

The allocator is ``vms`` on the simulated driver, warm (every round trip an exact reuse), so the
figures are the crossing plus the Python allocator, no driver work.

    python benchmarks/callback_overhead.py [--n 20000] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import time
from pathlib import Path

from vmstoolkit.integrations.testing import roundtrips_from_native_thread
from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN, make_handle
from vmstoolkit.pools import make_driver
from vmstoolkit.units import MiB

SIZE = 4 * MiB


def _ptr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _handle(pin: bool):
    h = make_handle("vms", driver_factory=lambda device: make_driver("sim"))
    if not pin:
        h.threads.pin = lambda: None
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="round trips per row")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    n = a.n

    empty_alloc = ALLOC_FN(lambda size, dev, stream: 4096)
    empty_free = FREE_FN(lambda ptr, size, dev, stream: None)
    roundtrips_from_native_thread(_ptr(empty_alloc), _ptr(empty_free), SIZE, 10)  # compile once

    rows = []

    def row(name: str, ok: int, seconds: float) -> None:
        assert ok == n, f"{name}: {ok} of {n} allocations succeeded"
        rows.append({"row": name, "round_trips": n, "us_per_call": seconds / (2 * n) * 1e6})

    row("empty callbacks", *roundtrips_from_native_thread(_ptr(empty_alloc), _ptr(empty_free), SIZE, n))
    for pin in (False, True):
        h = _handle(pin)
        row("vms handle" + ("" if pin else ", no pins"),
            *roundtrips_from_native_thread(h.alloc_ptr, h.free_ptr, SIZE, n))
    h = _handle(True)
    alloc, free = ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)
    t0 = time.perf_counter()
    ok = 0
    for _ in range(n):
        p = alloc(SIZE, 0, None)
        ok += p is not None
        free(p, SIZE, 0, None)
    row("vms handle, Python thread", ok, time.perf_counter() - t0)

    from vmstoolkit.integrations.native_torch import NativeHook

    hook = NativeHook(lambda device: make_driver("sim"))
    try:
        roundtrips_from_native_thread(hook.alloc_ptr, hook.free_ptr, SIZE, 10)  # maps the pages once
        row("paged hook (compiled)", *roundtrips_from_native_thread(hook.alloc_ptr, hook.free_ptr, SIZE, n))
    finally:
        hook.close()

    base = next(r["us_per_call"] for r in rows if r["row"] == "vms handle")
    print(f"{'row':28s} {'us/call':>8s} {'vs vms handle':>14s}")
    for r in rows:
        r["ratio_to_vms_handle"] = r["us_per_call"] / base
        print(f"{r['row']:28s} {r['us_per_call']:8.2f} {r['ratio_to_vms_handle']:13.2f}x")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.platform(), "processor": platform.processor(), "python": platform.python_version()}
        (a.out / "callback_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
