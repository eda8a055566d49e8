"""Can a cheap fast path in front of ``vms`` bring PyTorch's step time within 5%? A study on the traces.

    python experiments/fast_path_study.py [--out experiments/results/fast_path_study] [--passes 5] [--traces SNAPSHOT ...]

On the H200 (``experiments/results/train-h200/``) ``vms`` costs 3.6-5.5 us of Python per
allocation or free, 8-16k of them per training step: 1.43x (full) and 1.75x (LoRA) PyTorch's
step time. This study prices, on the bundled traces and the simulated driver, the two designs
that would keep the allocator in Python but call it less often, against the number that
matters for each: how many calls still reach Python, what the driver work of steady state
becomes, and what peak reserved memory becomes.

Rows, each trace replayed ``--passes`` times in a row (steady state: passes 3 and later, as in
``experiments/vms_policy.py``; the driver cost model is ``common.COST_US``):

- ``vms``: every allocation and free goes to Python (today's integration).
- ``vms + exact-size front``: a front of freed blocks by exact (size, stream), as native code
  could serve it: a request for a cached size takes the block back without Python; a free is
  only recorded. ``vms`` sees the cached blocks when a request would otherwise make it do
  driver work (no exact, split, prefix or reuse path serves it): then every cached block is
  freed into it first (``drain``), so stitching still sees all free memory.
- ``caching over vms (max_split N)``: PyTorch's own caching allocator (native) with a private
  memory pool whose segments come from ``vms`` (``torch.cuda.MemPool`` with a pluggable
  allocator). Python runs only for new segments. The pool gives cached segments back only as
  PyTorch's first retry does (oversize blocks, with ``max_split_size_mb``), so the segment
  allocator refuses once when ``vms`` has no free physical memory for the request, which makes
  PyTorch free oversize cached blocks into ``vms`` and ask again (the retry is served).
- ``pytorch-caching`` and ``pytorch-expandable``: PyTorch's two modes, for the peak (native:
  no Python calls; their driver work is ``cudaMalloc``/VMM calls the model does not price).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Callable, NamedTuple

from common import grid, priced, replay_passes, sweep, write
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.baselines.pytorch_caching import AllocatorSegments, PyTorchCachingAllocator


class ExactFront:
    """Freed blocks by exact (size, stream) in front of a ``vms`` allocator (see the docstring)."""

    def __init__(self, vms) -> None:
        self.vms = vms
        self.by_key: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        self.cached: dict[int, tuple[int, int]] = {}
        self.live: dict[int, tuple[int, int]] = {}
        self.python_calls = 0

    def _cheap(self, n: int) -> bool:
        """Would ``vms`` serve ``n`` chunks without driver work (exact, split, prefix, reuse)?"""
        a = self.vms
        prim, st = a.primitives, a.stitched
        return (prim.best_fit(n) is not None or st.best_fit(n, n) is not None
                or (a.policy.stitched_prefix and st.best_prefix(n) is not None)
                or st.best_fit(n, int(n * a.policy.reuse_max_ratio)) is not None)

    def drain(self) -> None:
        for addr in list(self.cached):
            self.vms.free(addr)
            self.python_calls += 1
        self.cached.clear()
        self.by_key.clear()

    def allocate(self, size: int, stream: int) -> int:
        blocks = self.by_key.get((size, stream))
        if blocks:
            addr = blocks.pop()
            del self.cached[addr]
        else:
            n = -(-size // self.vms.g)
            if self.cached and size > self.vms.policy.small_size and not self._cheap(n):
                self.drain()
            self.python_calls += 1
            addr = self.vms.allocate(size, stream)
        self.live[addr] = (size, stream)
        return addr

    def free(self, addr: int) -> None:
        key = self.live.pop(addr)
        self.by_key[key].append(addr)
        self.cached[addr] = key

    def stats(self):
        return self.vms.stats()

    def close(self) -> None:
        self.vms.close()


class RefuseOnceVms:
    """``vms`` as the segment source of PyTorch's caching allocator in a private pool (the
    :class:`~vmstoolkit.pools.baselines.pytorch_caching.SegmentSource` protocol, over
    :class:`AllocatorSegments`): it refuses a segment once when ``vms`` has no free physical
    memory for it, so that PyTorch frees oversize cached blocks into ``vms`` and asks again (the
    retry is served). Every call reaching it is a Python call."""

    keeps_cached = True  # a private pool in use keeps its cached blocks (PyTorch's release_cached_blocks)

    def __init__(self, driver) -> None:
        self.inner = AllocatorSegments(make_allocator("vms", driver))
        self.vms, self.driver = self.inner.upstream, driver
        self._refused: int | None = None
        self.python_calls = 0

    def allocate(self, nbytes: int) -> int | None:
        self.python_calls += 1
        if self.vms.primitives.free_chunks * self.driver.granularity < nbytes and self._refused != nbytes:
            self._refused = nbytes  # refuse once: PyTorch frees oversize cached blocks and asks again
            return None
        self._refused = None
        return self.inner.allocate(nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        self.python_calls += 1
        self.inner.free(ptr, nbytes)

    def check(self, caching) -> None:
        self.inner.check(caching)

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    def close(self) -> None:
        self.inner.close()


def caching_over_vms(driver, config: str) -> PyTorchCachingAllocator:
    """PyTorch's caching allocator in a private pool whose segments come from ``vms``."""
    return PyTorchCachingAllocator(driver, config, segments=RefuseOnceVms)


class Design(NamedTuple):
    make: Callable  # driver -> the allocator the replay calls
    python: float | None = None  # Python calls per request when fixed; None: python_calls(target) counts them
    end_pass: Callable | None = None
    python_calls: Callable = lambda t: t.python_calls


def replay(trace, design: Design, passes: int) -> dict:
    """Replay ``trace`` ``passes`` times through the design: Python calls per request and modelled
    driver time per pass in steady state (:func:`common.steady`), peak reserved and utilization."""
    counters = (lambda t: {"python_calls": design.python_calls(t)}) if design.python is None else None
    r = replay_passes(trace, design.make, passes, counters=counters, end_pass=design.end_pass)
    return priced(r, python_per_request=lambda p: design.python if design.python is not None
                  else p["counters"]["python_calls"] / p["requests"])


ROWS = {
    "vms": Design(lambda d: make_allocator("vms", d), python=1.0),  # every request reaches Python
    "vms + exact-size front": Design(lambda d: ExactFront(make_allocator("vms", d)), end_pass=ExactFront.drain),
    "caching over vms (max_split 21)": Design(lambda d: caching_over_vms(d, "max_split_size_mb:21"),
                                              python_calls=lambda t: t.segment_source.python_calls),
    "caching over vms (max_split 64)": Design(lambda d: caching_over_vms(d, "max_split_size_mb:64"),
                                              python_calls=lambda t: t.segment_source.python_calls),
    "pytorch-caching": Design(lambda d: make_allocator("pytorch-caching", d), python=0.0),  # native
    "pytorch-expandable": Design(lambda d: make_allocator("pytorch-expandable", d), python=0.0),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--traces", type=Path, nargs="+", default=None, help="snapshots instead of the bundled traces")
    args = ap.parse_args()
    rows = sweep(ROWS, lambda trace, label: replay(trace, ROWS[label], args.passes), "design",
                 lambda r: f"peak {r['peak_reserved'] / 2**30:6.2f} GiB  util {r['utilization']:.3f}  "
                 f"python/request {r['python_per_request']:.3f}  steady driver {r['steady_driver_ms']:7.1f} ms/pass",
                 args.traces)
    write(args.out, "fast_path_study", rows, grid(
        rows, "design", lambda r: f"{r['peak_reserved'] / 2**30:.2f} GiB / {r['python_per_request']:.2f} / "
        f"{r['steady_driver_ms']:.0f} ms", "design"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
