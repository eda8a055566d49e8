"""The framework-neutral side of an integration: pointers in, pointers out, statistics.

A framework hands over raw ``malloc(size) -> ptr`` and ``free(ptr)`` requests, possibly from
several threads (PyTorch's autograd engine frees from its own threads). The bridge serialises
them with a lock, turns a zero-size request into the null pointer, never lets an exception
cross into C (a failure returns the null pointer and is kept in ``last_error``), and reports
statistics in PyTorch's ``memory_stats()`` vocabulary.

PyTorch's pluggable hook does not check the pointer it gets: a null one becomes a tensor whose
first use fails far from the cause (``invalid argument`` in a copy, an illegal address in a
kernel). So every failed allocation is also reported on standard error at once
(:func:`report_failed_malloc`), naming the size, the device and the allocator's error.
"""

from __future__ import annotations

import sys
import threading
import time

from vmstoolkit.errors import OutOfMemoryError, VmsError
from vmstoolkit.pools.base import Allocator


class AllocatorBridge:
    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None
        self.failed_mallocs = 0
        self.failed_frees = 0
        self.seconds = 0.0  # wall time spent inside malloc and free (allocator CPU cost)

    def malloc(self, size: int) -> int:
        """Device pointer of a new ``size``-byte allocation; 0 for size 0 or on failure."""
        if size == 0:
            return 0
        with self._lock:
            t0 = time.perf_counter()
            try:
                return self.allocator.allocate(int(size))
            except (VmsError, MemoryError) as e:
                self.last_error = e
                self.failed_mallocs += 1
                report_failed_malloc(size, None, e)
                return 0
            finally:
                self.seconds += time.perf_counter() - t0

    def free(self, ptr: int) -> None:
        """Free ``ptr`` (0 is ignored); a bad pointer is recorded, never raised into C."""
        if not ptr:
            return
        with self._lock:
            t0 = time.perf_counter()
            try:
                self.allocator.free(int(ptr))
            except VmsError as e:
                self.last_error = e
                self.failed_frees += 1
            finally:
                self.seconds += time.perf_counter() - t0

    def stats(self) -> dict:
        with self._lock:
            return torch_style_stats(self.allocator)


def report_failed_malloc(size: int, device: int | None, error: BaseException) -> None:
    """One line on standard error for an allocation that returns the null pointer (PyTorch will
    not say why when it trips over it later)."""
    where = "" if device is None else f" on device {device}"
    sys.stderr.write(f"vmstoolkit: could not allocate {size} bytes{where} ({type(error).__name__}: {error}); "
                     "the framework gets a null pointer and will fail where it first uses it\n")
    sys.stderr.flush()


class HandleStats:
    """PyTorch's statistics calls for a handle whose ``bridge(device)`` has ``stats()``."""

    def memory_stats(self, device: int = 0) -> dict:
        """``torch.cuda.memory_stats()``-style statistics of the allocator on ``device``."""
        return self.bridge(device).stats()

    def max_memory_reserved(self, device: int = 0) -> int:
        return self.memory_stats(device)["reserved_bytes.all.peak"]

    def max_memory_allocated(self, device: int = 0) -> int:
        return self.memory_stats(device)["allocated_bytes.all.peak"]


def torch_style_stats(allocator: Allocator) -> dict:
    """An allocator's statistics under the names ``torch.cuda.memory_stats()`` uses.

    ``allocated_bytes`` here are the bytes requested (PyTorch counts its rounded blocks);
    ``reserved_bytes`` the physical bytes the allocator holds from the driver.
    """
    s = allocator.stats()
    return {
        "allocated_bytes.all.current": s.allocated_bytes,
        "allocated_bytes.all.peak": s.peak_allocated_bytes,
        "requested_bytes.all.current": s.allocated_bytes,
        "requested_bytes.all.peak": s.peak_allocated_bytes,
        "reserved_bytes.all.current": s.reserved_bytes,
        "reserved_bytes.all.peak": s.peak_reserved_bytes,
        "active.all.current": s.allocated_count,
        "active.all.peak": s.peak_allocated_count,
        "allocation.all.allocated": s.total_allocs,
        "allocation.all.freed": s.total_frees,
        "num_ooms": s.num_ooms,
        "num_alloc_retries": 0,
        "num_device_alloc": s.driver_calls.get("create", 0) + s.driver_calls.get("mem_alloc", 0),
        "num_device_free": s.driver_calls.get("release", 0) + s.driver_calls.get("mem_free", 0),
    }


__all__ = ["AllocatorBridge", "HandleStats", "report_failed_malloc", "torch_style_stats", "OutOfMemoryError"]
