"""The framework-neutral side of an integration: pointers in, pointers out, statistics.

A framework hands over raw ``malloc(size, stream) -> ptr`` and ``free(ptr, stream)`` requests,
possibly from several threads (PyTorch's autograd engine frees from its own threads). The bridge
serialises them with a lock, turns a zero-size request into the null pointer, never lets an
exception cross into C (a failure returns the null pointer and is kept in ``last_error``), and
reports statistics in PyTorch's ``memory_stats()`` vocabulary through one function,
:func:`torch_stats`, over the allocator's :class:`~vmstoolkit.pools.base.AllocatorStats`.

PyTorch's bare pluggable hook does not check the pointer it gets: a null one becomes a tensor
whose first use fails far from the cause. The PyTorch integration's compiled shim
(:mod:`vmstoolkit.integrations.torch_shim`) raises ``torch.OutOfMemoryError`` instead; without
the shim every failed allocation is at least reported on standard error at once
(:func:`report_failed_malloc`), naming the size, the device and the allocator's error.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, TypeVar

from vmstoolkit.errors import OutOfMemoryError, VmsError
from vmstoolkit.pools.adaptors import AllocatorAdaptor, unwrap
from vmstoolkit.pools.base import Allocator, AllocatorStats
from vmstoolkit.pools.drivers import VMMDriver, make_driver

T = TypeVar("T")


def per_device(table: dict[int, T], lock: threading.Lock, device: int, make: Callable[[], T]) -> T:
    """``table[device]``, made by ``make()`` on first use, once, whichever threads ask at the same
    time: the lookup takes no lock once the entry exists, and ``make`` runs under ``lock`` (its
    result enters ``table`` only when it returns, so a failed ``make`` leaves nothing behind).
    Every integration keeps one bridge per device so (PyTorch, its compiled hook, CuPy).
    Runtime complexity: O(1) once made.

    >>> table, made = {}, []
    >>> per_device(table, threading.Lock(), 0, lambda: made.append(0) or "bridge 0")
    'bridge 0'
    >>> per_device(table, threading.Lock(), 0, lambda: made.append(0) or "again"), made
    ('bridge 0', [0])
    """
    obj = table.get(device)
    if obj is None:
        with lock:
            obj = table.get(device)
            if obj is None:
                obj = table[device] = make()
    return obj


def cuda_driver(device: int) -> VMMDriver:
    """The real driver of ``device``: the integrations' default ``driver_factory``."""
    return make_driver("cuda", device=device)


class AllocatorBridge:
    """One allocator behind a lock. A free that arrives *while this thread is inside the
    allocator* (Python's garbage collector runs at any allocation of a Python object, and may
    drop a tensor whose deleter calls back here) is queued and done when the outer call leaves:
    re-entering would deadlock on the lock, or change the allocator's state half-way through."""

    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside the allocator
        self._reentrant_frees: list[tuple[int, int | None]] = []
        self.last_error: BaseException | None = None
        self.failed_mallocs = 0
        self.failed_frees = 0
        self.seconds = 0.0  # wall time spent inside malloc and free (allocator CPU cost)

    def malloc(self, size: int, stream: int = 0, report: bool = True) -> int:
        """Device pointer of a new ``size``-byte allocation on ``stream``; 0 for size 0 or on
        failure (reported on standard error unless ``report`` is False: the shim raises instead)."""
        if size == 0:
            return 0
        with self._lock:
            self._owner = threading.get_ident()
            t0 = time.perf_counter()
            try:
                return self.allocator.allocate(int(size), int(stream))
            except (VmsError, MemoryError) as e:
                self.last_error = e
                self.failed_mallocs += 1
                if report:
                    report_failed_malloc(size, None, e)
                return 0
            finally:
                self._leave()
                self.seconds += time.perf_counter() - t0

    def free(self, ptr: int, stream: int | None = None) -> None:
        """Free ``ptr`` (0 is ignored); a bad pointer is recorded, never raised into C."""
        if not ptr:
            return
        if self._owner == threading.get_ident():  # re-entered from inside the allocator (see the class)
            self._reentrant_frees.append((int(ptr), stream))
            return
        with self._lock:
            self._owner = threading.get_ident()
            t0 = time.perf_counter()
            try:
                self._free_one(int(ptr), stream)
            finally:
                self._leave()
                self.seconds += time.perf_counter() - t0

    def _free_one(self, ptr: int, stream: int | None) -> None:
        try:
            self.allocator.free(ptr, stream)
        except VmsError as e:
            self.last_error = e
            self.failed_frees += 1

    def _leave(self) -> None:
        """Do the frees queued by re-entry, then let other threads in."""
        while self._reentrant_frees:
            self._free_one(*self._reentrant_frees.pop(0))
        self._owner = None

    def wrap(self, make: Callable[[Allocator], AllocatorAdaptor]) -> AllocatorAdaptor:
        """Put the adaptor ``make(allocator)`` around the allocator, between two calls; returns it."""
        with self._inside():
            self.allocator = make(self.allocator)
            return self.allocator

    def unwrap(self, adaptor: AllocatorAdaptor) -> None:
        """Take ``adaptor`` out of the allocator's chain of adaptors, between two calls."""
        with self._inside():
            self.allocator = unwrap(self.allocator, adaptor)

    def held(self):
        """``with bridge.held():`` the allocator is this thread's alone (re-entering frees queued)."""
        return self._inside()

    @contextmanager
    def _inside(self):
        """The lock, for the cold calls: a free that re-enters meanwhile is queued, as in malloc."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._leave()

    def record_stream(self, ptr: int, stream: int) -> None:
        with self._inside():
            try:
                self.allocator.record_stream(int(ptr), int(stream))
            except VmsError as e:
                self.last_error = e

    def allocator_stats(self) -> AllocatorStats:
        with self._inside():
            return self.allocator.stats()

    def stats(self) -> dict:
        return torch_stats(self.allocator_stats())

    def reset_peak(self) -> None:
        with self._inside():
            self.allocator.reset_peak_stats()

    def reset_accumulated(self) -> None:
        with self._inside():
            self.allocator.reset_accumulated_stats()

    def empty_cache(self) -> None:
        with self._inside():
            self.allocator.empty_cache()


def report_failed_malloc(size: int, device: int | None, error: BaseException) -> None:
    """One line on standard error for an allocation that returns the null pointer (PyTorch will
    not say why when it trips over it later)."""
    where = "" if device is None else f" on device {device}"
    sys.stderr.write(f"vmstoolkit: could not allocate {size} bytes{where} ({type(error).__name__}: {error}); "
                     "the framework gets a null pointer and will fail where it first uses it\n")
    sys.stderr.flush()


def pytorch_size(n: int) -> str:
    """A byte count as PyTorch's allocator writes it in its messages (``format_size``): "100 bytes"
    up to 1 KiB, then KiB, MiB and GiB with two decimals, each up to and including its unit.

    >>> pytorch_size(1000), pytorch_size(3 << 20), pytorch_size(1 << 30), pytorch_size(3 << 30)
    ('1000 bytes', '3.00 MiB', '1024.00 MiB', '3.00 GiB')
    """
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


OOM_PREFIX = "CUDA out of memory. Tried to allocate "
"""How PyTorch's own out-of-memory message begins; what accelerate's ``should_reduce_batch_size``
and Lightning's ``is_oom_error`` look for."""


def oom_message(size: int, device: int, free: int, total: int, allocated: int, reserved: int, why: str) -> str:
    """An out-of-memory message that begins as PyTorch's caching allocator's does, word for word,
    then gives the allocator's figures and ``why``."""
    return (f"{OOM_PREFIX}{pytorch_size(size)}. GPU {device} has a total capacity of {pytorch_size(total)} of which "
            f"{pytorch_size(free)} is free. Of the allocated memory {pytorch_size(allocated)} is allocated by PyTorch, "
            f"and {pytorch_size(max(0, reserved - allocated))} is reserved by PyTorch but unallocated. "
            f"vmstoolkit: {why}")


# The statistics the compiled shim hands PyTorch (``getDeviceStats``), in this order: the shim's
# C++ reads the same list (vmstoolkit/integrations/csrc/torch_shim.cpp, ``enum Stat``).
STAT_KEYS = (
    "allocated_bytes.all.current", "allocated_bytes.all.peak", "allocated_bytes.all.allocated",
    "allocated_bytes.all.freed", "reserved_bytes.all.current", "reserved_bytes.all.peak",
    "active.all.current", "active.all.peak", "allocation.all.allocated", "allocation.all.freed",
    "num_ooms", "num_device_alloc", "num_device_free", "num_alloc_retries",
)


def torch_stats(s: AllocatorStats) -> dict:
    """An allocator's statistics under the names ``torch.cuda.memory_stats()`` uses: the one
    place they are named, for the handle, the shim and the fallback alike.

    ``allocated``, ``requested`` and ``active`` bytes are the bytes requested by live
    allocations (PyTorch counts its rounded blocks for the first and third); ``reserved`` bytes
    the physical bytes mapped for the allocator (``cuMemCreate`` chunks or plain allocations).
    Per size class (``small_pool``, ``large_pool``) where the allocator keeps them
    (:attr:`AllocatorStats.pools`: a :class:`~vmstoolkit.pools.adaptors.StatisticsAdaptor`).
    """
    freed = s.total_allocated_bytes - s.allocated_bytes
    out = {
        "allocated_bytes.all.current": s.allocated_bytes,
        "allocated_bytes.all.peak": s.peak_allocated_bytes,
        "allocated_bytes.all.allocated": s.total_allocated_bytes,
        "allocated_bytes.all.freed": freed,
        "reserved_bytes.all.current": s.reserved_bytes,
        "reserved_bytes.all.peak": s.peak_reserved_bytes,
        "active.all.current": s.allocated_count,
        "active.all.peak": s.peak_allocated_count,
        "allocation.all.allocated": s.total_allocs,
        "allocation.all.freed": s.total_frees,
        "num_ooms": s.num_ooms,
        "num_device_alloc": s.driver_calls.get("create", 0) + s.driver_calls.get("mem_alloc", 0),
        "num_device_free": s.driver_calls.get("release", 0) + s.driver_calls.get("mem_free", 0),
        "num_alloc_retries": 0,
    }
    out["requested_bytes.all.current"] = out["active_bytes.all.current"] = s.allocated_bytes
    out["requested_bytes.all.peak"] = out["active_bytes.all.peak"] = s.peak_allocated_bytes
    for pool, p in s.pools.items():
        for metric in ("allocated_bytes", "requested_bytes", "active_bytes"):
            out.update({f"{metric}.{pool}.current": p["current_bytes"], f"{metric}.{pool}.peak": p["peak_bytes"],
                        f"{metric}.{pool}.allocated": p["total_bytes"], f"{metric}.{pool}.freed": p["freed_bytes"]})
        for metric in ("allocation", "active"):
            out.update({f"{metric}.{pool}.current": p["current_count"], f"{metric}.{pool}.peak": p["peak_count"],
                        f"{metric}.{pool}.allocated": p["total_count"], f"{metric}.{pool}.freed": p["freed_count"]})
    return out


def torch_style_stats(allocator: Allocator) -> dict:
    """:func:`torch_stats` of ``allocator`` (kept for existing callers)."""
    return torch_stats(allocator.stats())


class HandleStats:
    """PyTorch's statistics calls for a handle whose ``bridge(device)`` has ``stats()``."""

    def memory_stats(self, device: int = 0) -> dict:
        """``torch.cuda.memory_stats()``-style statistics of the allocator on ``device``."""
        return self.bridge(device).stats()

    def max_memory_reserved(self, device: int = 0) -> int:
        return self.memory_stats(device)["reserved_bytes.all.peak"]

    def max_memory_allocated(self, device: int = 0) -> int:
        return self.memory_stats(device)["allocated_bytes.all.peak"]


__all__ = ["per_device", "cuda_driver", "AllocatorBridge", "HandleStats", "OOM_PREFIX", "STAT_KEYS", "oom_message", "pytorch_size", "report_failed_malloc", "torch_stats", "torch_style_stats",
           "OutOfMemoryError"]
