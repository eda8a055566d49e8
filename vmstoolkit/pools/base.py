"""The allocator protocol every allocator speaks, and the bookkeeping they all share.

The replay engine, the experiments and the Numba and PyTorch integrations only ever call
``allocate(size, stream)``, ``free(addr, stream)``, ``record_stream``, ``stats``,
``empty_cache``, ``close`` and ``_check`` (and read ``counts``, ``path_counts()``): they never
special-case an allocator, and never probe one for attributes it may lack. Limits, statistics
and logging are adaptors that wrap any allocator and speak the same protocol
(:mod:`vmstoolkit.pools.adaptors`).

Streams follow PyTorch's contract (:mod:`vmstoolkit.pools.streams`): a block freed by one stream
is reused at once by that stream only; another stream gets it once the work queued before the
free has finished. The base class keeps it for every allocator through
:class:`~vmstoolkit.pools.streams.DeferredFrees`; an allocator that orders streams itself
(``paged``) overrides :meth:`Allocator._free_streamed` and :meth:`Allocator.record_stream`.

:class:`Allocator` does what every allocator must do the same way: validate sizes, catch frees
of unknown addresses and double frees *before* touching any state, count requested bytes and
their peak, and read physical bytes from the driver. Subclasses implement ``_allocate`` and
``_free``.
"""

from __future__ import annotations

import numbers
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np
from vmstoolkit._jit import njit

from vmstoolkit.errors import (
    AllocatorClosedError,
    DoubleFreeError,
    DriverError,
    InvalidFreeError,
    InvalidSizeError,
    OutOfMemoryError,
)
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.streams import DeferredFrees

_FREED_MEMORY = 4096  # how many recently freed addresses are remembered to name a double free


@dataclass
class AllocatorStats:
    """Counters of one allocator, in the spirit of RMM's statistics and PyTorch's memory_stats.

    ``allocated_*`` count the bytes the program asked for (live requests); ``reserved_*``
    count the physical bytes the allocator holds from the driver.
    """

    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    allocated_count: int = 0
    peak_allocated_count: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    total_allocs: int = 0
    total_frees: int = 0
    total_allocated_bytes: int = 0  # bytes ever requested (PyTorch's ``allocated_bytes.all.allocated``)
    num_ooms: int = 0
    driver_calls: dict = field(default_factory=dict)
    pools: dict = field(default_factory=dict)
    """Per size class, where an allocator keeps them (:class:`~vmstoolkit.pools.adaptors.StatisticsAdaptor`):
    ``{"small_pool" | "large_pool": {"current_bytes", "peak_bytes", "total_bytes", "freed_bytes",
    "current_count", "peak_count", "total_count", "freed_count"}}``; empty otherwise."""

    @property
    def utilization(self) -> float:
        """Peak allocated / peak reserved (1.0 when nothing was reserved). Runtime complexity: O(1)."""
        return self.peak_allocated_bytes / self.peak_reserved_bytes if self.peak_reserved_bytes else 1.0

    @property
    def fragmentation(self) -> float:
        """1 - :attr:`utilization`: the share of the peak reserved bytes that held no request.
        Runtime complexity: O(1)."""
        return 1.0 - self.utilization

    def as_dict(self) -> dict:
        """The fields as a plain dict, with ``utilization`` and ``fragmentation``. Runtime
        complexity: O(fields + driver operations + pools)."""
        d = asdict(self)
        d["utilization"] = self.utilization
        d["fragmentation"] = self.fragmentation
        return d


@dataclass
class ReplayArrays:
    """A trace's allocs and frees as columns, for :meth:`Allocator.compiled_replay`.

    ``is_alloc``, ``addr`` (the trace's address), ``size`` and ``stream`` per event (int8 and
    int64); ``pre_addr`` and ``pre_ptr``: the memory live before recording that the replay has
    already allocated (trace address and the allocator's address, in allocation order)."""

    is_alloc: np.ndarray
    addr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    pre_addr: np.ndarray
    pre_ptr: np.ndarray
    pre_size: np.ndarray
    pre_stream: np.ndarray
    timeline: bool = False
    progress: Callable[[int], None] | None = None
    progress_every: int = 2000


@dataclass
class CompiledReplay:
    """What a compiled replay did: the same figures the Python replay loop keeps."""

    done: int
    oom_event: int | None = None
    oom_message: str = ""
    unmatched: int = 0
    double_free: tuple[int, int, int] | None = None
    """``(trace address, event, event of its earlier free)``: the replay stopped on a double free."""
    allocated: np.ndarray | None = None  # with ``timeline``: bytes allocated after each event
    reserved: np.ndarray | None = None  # with ``timeline``: physical bytes after each event
    loop_seconds: float = 0.0
    """Time spent in compiled code (the rest went to the driver's work, in Python)."""


C_ALLOCATED, C_PEAK_ALLOCATED, C_COUNT, C_PEAK_COUNT, C_TOTAL_ALLOCS, C_TOTAL_FREES, C_TOTAL_BYTES = range(7)
"""Indices of :data:`Allocator.COUNTERS` in an array of request counters."""


@njit(cache=True)
def count_alloc(c, size):
    """Count one allocation of ``size`` bytes in ``c``, an int64 array laid out as
    :data:`Allocator.COUNTERS`, as :meth:`Allocator.allocate` counts its own (compiled code may
    call it: the PyTorch hook's fast path does). Runtime complexity: O(1)."""
    c[C_ALLOCATED] += size
    c[C_TOTAL_BYTES] += size
    c[C_TOTAL_ALLOCS] += 1
    c[C_COUNT] += 1
    if c[C_ALLOCATED] > c[C_PEAK_ALLOCATED]:
        c[C_PEAK_ALLOCATED] = c[C_ALLOCATED]
    if c[C_COUNT] > c[C_PEAK_COUNT]:
        c[C_PEAK_COUNT] = c[C_COUNT]


@njit(cache=True)
def count_free(c, size):
    """Count the free of a ``size``-byte allocation in ``c`` (laid out as :data:`Allocator.COUNTERS`),
    as :meth:`Allocator.free` counts its own. Runtime complexity: O(1)."""
    c[C_ALLOCATED] -= size
    c[C_TOTAL_FREES] += 1
    c[C_COUNT] -= 1


class Allocator(ABC):
    """Base of every allocator. ``name`` is the registry name (``"vms"``, ``"pytorch-caching"``).

    Threads: an allocator is not safe to call from several threads at once (only ``paged``'s
    slow path takes a lock of its own). What the integrations serve is: the PyTorch and Numba
    bridges call it under one lock per device (:class:`~vmstoolkit.integrations.bridge.AllocatorBridge`),
    and the compiled ``paged`` hook under the GIL. Direct users sharing one allocator between
    threads must hold a lock around every call.
    """

    name: str = "abstract"
    streams_apart: bool = False
    """True for an allocator that never reuses one stream's free on another by itself (the
    PyTorch simulations keep a pool per stream; ``paged`` waits through tagged chunks)."""

    compiled_hook: str | None = None
    """``"module:Class"`` of compiled entry points that serve PyTorch (see
    :func:`vmstoolkit.integrations.torch.make_handle`); None: Python callbacks serve it."""

    recorded_settings_option: str | None = None
    """The option that takes the allocator settings a snapshot recorded
    (:func:`vmstoolkit.trace.settings.options_with_settings`): ``"config"`` for the PyTorch
    simulations, which replay a trace under the settings it ran with; None: the allocator's own
    options alone apply."""

    counts: Mapping[str, int] = MappingProxyType({})
    """How many requests each of the allocator's paths served (``{"exact": 3, "split": 1, ...}``
    for ``vms``); empty for an allocator with one path. Replay reports it as ``extra["paths"]``."""

    def __init__(self, driver: VMMDriver) -> None:
        self.driver = driver
        self._live: dict[int, int] = {}  # address -> requested size
        self._recently_freed: OrderedDict[int, None] = OrderedDict()
        self._allocated = 0
        self._peak_allocated = 0
        self._peak_count = 0
        self._total_allocs = 0
        self._total_frees = 0
        self._total_bytes = 0
        self._num_ooms = 0
        self._closed = False
        # A weak reference back: with ``self._free`` itself the allocator would sit in a reference
        # cycle and be freed only by the cyclic collector, which does not count the arrays it
        # holds (85 MB for paged on an H200-sized device): a loop making allocators grew by GBs.
        free = weakref.WeakMethod(self._free)
        self._streams = DeferredFrees(driver, lambda addr: free()(addr), streams_apart=self.streams_apart)

    # -- the protocol ----------------------------------------------------------------------
    def allocate(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes for use on ``stream``; returns the device address.

        Raises :class:`~vmstoolkit.errors.InvalidSizeError` for a size of zero or below and
        :class:`~vmstoolkit.errors.OutOfMemoryError` when physical memory cannot serve it, even
        after waiting for every held free (see :mod:`~vmstoolkit.pools.streams`).

        Runtime complexity: O(1) of bookkeeping plus the allocator's own placement (each
        allocator's class docstring states it); with several streams, plus the held frees whose
        events completed (each given back once) and one ``cuEventQuery`` while batches wait.
        """
        if self._closed:
            raise AllocatorClosedError(f"{self.name}: allocate({size!r}) after close(): the allocator is closed")
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidSizeError(f"allocation size must be an integer, got {size!r}")
        stream = self._stream(stream, "allocate")
        if size <= 0:
            raise InvalidSizeError(f"allocation size must be positive, got {size}")
        if size > self.driver.capacity:  # no allocator can serve it: say so before touching the driver
            self._num_ooms += 1
            raise OutOfMemoryError(f"{self.name}: out of memory: a request of {size} bytes is larger than the device "
                                   f"({self.driver.capacity} bytes)", requested=size,
                                   reserved=self.driver.physical_bytes, capacity=self.driver.capacity)
        st = self._streams
        st.on_allocate(stream)
        addr = st.reuse(size, stream) if st.multi else None
        if addr is None:
            st.collect()
            try:
                addr = self._allocate(size, stream)
            except OutOfMemoryError:
                if not st.holding:
                    self._num_ooms += 1
                    raise
                st.drain()  # every held free back, after the device is idle; then once more
                try:
                    addr = self._allocate(size, stream)
                except OutOfMemoryError:
                    self._num_ooms += 1
                    raise
        st.note_stream(addr, stream)
        self._live[addr] = size
        self._recently_freed.pop(addr, None)
        self._allocated += size
        self._total_allocs += 1
        self._total_bytes += size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        if len(self._live) > self._peak_count:
            self._peak_count = len(self._live)
        return addr

    def free(self, addr: int, stream: int | None = None) -> None:
        """Free the allocation that starts at ``addr``.

        ``stream`` is the stream the caller frees on (PyTorch passes the one it allocated on);
        a stream other than the allocation's counts as a use on it, as ``record_stream`` does.
        An address that no live allocation starts at raises
        :class:`~vmstoolkit.errors.DoubleFreeError` (recently freed) or
        :class:`~vmstoolkit.errors.InvalidFreeError` (unknown, or not an integer), and changes
        nothing; after :meth:`close`, :class:`~vmstoolkit.errors.AllocatorClosedError`.

        Runtime complexity: O(1) of bookkeeping plus the allocator's own free (its class
        docstring); a free held for other streams' work costs O(1) now and the allocator's free
        when its event completes.
        """
        if self._closed:
            raise AllocatorClosedError(f"{self.name}: free({addr!r:.60}) after close(): the allocator is closed")
        self._free_live(self._address(addr, "free"), None if stream is None else self._stream(stream, "free"))

    def _free_live(self, addr: int, stream: int | None = None) -> None:
        size = self._live.get(addr)
        if size is None:
            if addr in self._recently_freed:
                raise DoubleFreeError(f"double free of address {addr:#x}")
            raise InvalidFreeError(f"free of unknown address {addr:#x}")
        try:
            self._free_streamed(addr, size, stream)
        except DriverError:
            # The pool let go of the block before its driver teardown failed; the failed steps
            # wait in its graveyard for empty_cache/close. The allocation is gone either way.
            self._forget(addr, size)
            raise
        self._forget(addr, size)

    def record_stream(self, addr: int, stream: int) -> None:
        """Work on ``stream`` uses the live allocation at ``addr``: once freed, it is not reused
        before that work, as queued up to the free, has finished (``Tensor.record_stream``).
        Runtime complexity: O(1)."""
        addr, stream = self._address(addr, "record_stream"), self._stream(stream, "record_stream")
        if addr not in self._live:
            raise InvalidFreeError(f"record_stream of address {addr:#x}, which is not a live allocation")
        self._streams.record(addr, stream, self._streams.own_stream(addr))

    def _address(self, addr, call: str) -> int:
        """``addr`` as an ``int`` (numpy's integers too), or the invalid-free error for a value that
        is no address (a float, a string, None, a bool), which the hex in later messages cannot format."""
        if type(addr) is int:  # the common case first: an ABC isinstance costs a Python-level check
            return addr
        if isinstance(addr, bool) or not isinstance(addr, numbers.Integral):
            raise InvalidFreeError(f"{self.name}: {call} of {addr!r:.60}: an address is an integer")
        return int(addr)

    def _stream(self, stream, call: str) -> int:
        """``stream`` as an ``int`` (a CUDA stream handle, as PyTorch passes it: 0 is the default
        stream), or a one-line error for anything else: a string, None, a float, a bool, or a
        value outside int64, which the compiled paths store."""
        if type(stream) is int and -(1 << 63) <= stream < (1 << 63):  # the common case, without the ABC check
            return stream
        if isinstance(stream, bool) or not isinstance(stream, numbers.Integral) or not -(1 << 63) <= stream < (1 << 63):
            raise InvalidSizeError(f"{self.name}: {call} on stream {stream!r:.60}: a stream is an int64 handle")
        return int(stream)

    def _free_streamed(self, addr: int, size: int, stream: int | None) -> None:
        """Free now when no other stream's queued work can use the block; else hold it."""
        streams = self._streams.streams_at_free(addr, stream)
        if streams is None:
            self._free(addr)
        else:
            self._streams.hold(addr, size, streams)

    def _forget(self, addr: int, size: int) -> None:
        del self._live[addr]
        self._recently_freed[addr] = None
        if len(self._recently_freed) > _FREED_MEMORY:
            self._recently_freed.popitem(last=False)
        self._allocated -= size
        self._total_frees += 1

    @property
    def allocated_bytes(self) -> int:
        """Bytes of live requests now (no stats object). Runtime complexity: O(1)."""
        return self._allocated

    # -- bookkeeping for compiled paths ----------------------------------------------------
    COUNTERS = ("allocated", "peak_allocated", "count", "peak_count", "total_allocs", "total_frees", "total_bytes")
    """The request counters, in the order :meth:`export_counters` lays them out."""

    def export_counters(self) -> np.ndarray:
        """The request counters as a fresh int64 array laid out as :data:`COUNTERS`, for a
        compiled path that serves requests outside :meth:`allocate` and :meth:`free` (``paged``'s
        compiled replay) to keep while it runs; it hands them back with :meth:`report_compiled`.
        Cost: O(1)."""
        return np.array([self._allocated, self._peak_allocated, len(self._live), self._peak_count,
                         self._total_allocs, self._total_frees, self._total_bytes], np.int64)

    def stream_home(self) -> int | None:
        """The one stream seen so far (``None`` before the first request), which a compiled
        path needs to tell a single-stream run from a multi-stream one. Runtime complexity: O(1)."""
        return self._streams.home

    def block_streams(self) -> dict[int, int]:
        """address -> stream of every block the stream bookkeeping places off :meth:`stream_home` (a copy).
        Runtime complexity: O(such blocks)."""
        return dict(self._streams.stream_of)

    def report_compiled(self, counters, *, live: dict[int, int], stream_of: dict[int, int], home: int | None,
                        freed: list[int]) -> None:
        """Take back what a compiled path did, as if every request had gone through
        :meth:`allocate` and :meth:`free`: ``counters`` (:data:`COUNTERS`; the live count is
        ``len(live)``), every live allocation (address -> requested size, in allocation order),
        the stream of each one not on ``home``, ``home`` itself, and the addresses freed, oldest
        first (the latest :data:`_FREED_MEMORY` are remembered to name a double free).
        Cost: O(live + freed)."""
        (self._allocated, self._peak_allocated, _, self._peak_count, self._total_allocs, self._total_frees,
         self._total_bytes) = (int(x) for x in counters[:7])
        self._live = live
        self._streams.home = home
        self._streams.stream_of = stream_of
        rf = self._recently_freed
        for p in list(rf):
            if p in live:
                del rf[p]
        for p in freed:
            rf.pop(p, None)
            rf[p] = None
        while len(rf) > _FREED_MEMORY:
            rf.popitem(last=False)

    def note_oom(self) -> None:
        """Count an out-of-memory failure met on a compiled path (as :meth:`allocate` counts its
        own; only out-of-memory errors, a driver error is not one). Runtime complexity: O(1)."""
        self._num_ooms += 1

    def size_of(self, addr: int) -> int:
        """The requested size of the live allocation at ``addr``. Runtime complexity: O(1)."""
        addr = self._address(addr, "size_of")
        try:
            return self._live[addr]
        except KeyError:
            raise InvalidFreeError(f"no live allocation at address {addr:#x}") from None

    def stats(self) -> AllocatorStats:
        """The counters now, as a new :class:`AllocatorStats` (requested bytes and counts with
        their peaks, reserved bytes from the driver, totals, out-of-memory count, driver calls).
        Runtime complexity: O(driver operations), for the copy of the call counts."""
        return self.stats_of((self._allocated, self._peak_allocated, len(self._live), self._peak_count,
                              self._total_allocs, self._total_frees, self._total_bytes))

    def stats_of(self, counters) -> AllocatorStats:
        """:meth:`stats` for requests a compiled path counts in an array of its own, laid out as
        :data:`COUNTERS` and kept with :func:`count_alloc` and :func:`count_free` (the PyTorch
        hook's fast path, whose requests never reach :meth:`allocate`): the request figures from
        ``counters``, the reserved bytes, the out-of-memory count (:meth:`note_oom`) and the
        driver calls from this allocator, exactly as :meth:`stats` reads its own.
        Runtime complexity: O(driver operations), for the copy of the call counts."""
        c = [int(x) for x in counters[:7]]
        return AllocatorStats(
            allocated_bytes=c[C_ALLOCATED],
            peak_allocated_bytes=c[C_PEAK_ALLOCATED],
            allocated_count=c[C_COUNT],
            peak_allocated_count=c[C_PEAK_COUNT],
            reserved_bytes=self.driver.physical_bytes,
            peak_reserved_bytes=self.driver.peak_physical_bytes,
            total_allocs=c[C_TOTAL_ALLOCS],
            total_frees=c[C_TOTAL_FREES],
            total_allocated_bytes=c[C_TOTAL_BYTES],
            num_ooms=self._num_ooms,
            driver_calls=dict(self.driver.calls),
        )

    def reset_peak_stats(self) -> None:
        """Start the peaks (allocated bytes and count, reserved bytes) again from the current
        values. Runtime complexity: O(1)."""
        self._peak_allocated = self._allocated
        self._peak_count = len(self._live)
        self.driver.reset_peak()

    def reset_peaks_of(self, counters) -> None:
        """:meth:`reset_peak_stats` for a compiled path's own ``counters`` (see :meth:`stats_of`):
        their peaks start again from their current values, and so does the driver's reserved
        peak. Runtime complexity: O(1)."""
        counters[C_PEAK_ALLOCATED] = counters[C_ALLOCATED]
        counters[C_PEAK_COUNT] = counters[C_COUNT]
        self.driver.reset_peak()

    def reset_accumulated_stats(self) -> None:
        """Zero the running totals (allocations, frees, bytes ever requested, out-of-memory count).
        Runtime complexity: O(1)."""
        self._total_allocs = self._total_frees = self._total_bytes = self._num_ooms = 0

    def reset_totals_of(self, counters) -> None:
        """:meth:`reset_accumulated_stats` for a compiled path's own ``counters`` (see
        :meth:`stats_of`): their totals and this allocator's out-of-memory count are zeroed.
        Runtime complexity: O(1)."""
        counters[C_TOTAL_ALLOCS] = counters[C_TOTAL_FREES] = counters[C_TOTAL_BYTES] = 0
        self._num_ooms = 0

    def _held_by_core(self) -> dict[int, int]:
        """address -> requested size of every block the core still holds as allocated: the live
        ones and the freed ones held for other streams' queued work (:mod:`~vmstoolkit.pools.streams`)."""
        return {**self._live, **self._streams.held()}

    def live_allocations(self) -> dict[int, int]:
        """address -> requested size of every live allocation (a copy). Runtime complexity: O(live)."""
        return dict(self._live)

    def empty_cache(self) -> None:
        """Give every cached byte that no live allocation uses back to the driver (after the
        device has finished the work queued on blocks freed by other streams).
        Runtime complexity: O(cached blocks), each given back with its driver calls; with held
        frees, one device synchronize first."""
        self._streams.drain()
        self._empty_cache()

    def _empty_cache(self) -> None:
        """What the allocator caches, given back (subclasses)."""

    def close(self) -> None:
        """Free every live allocation and give everything back to the driver.

        Keeps going past driver errors (their steps wait in the graveyard and are retried by
        the final ``empty_cache``); the first error is raised at the end. Afterwards the allocator
        refuses :meth:`allocate` and :meth:`free` (:class:`~vmstoolkit.errors.AllocatorClosedError`);
        a second ``close`` retries what the graveyard still holds.

        Runtime complexity: O(live) frees, then :meth:`empty_cache`.
        """
        self._closed = True
        first: DriverError | None = None
        for addr in list(self._live):
            try:
                self._free_live(addr)
            except DriverError as e:
                first = first or e
        self.empty_cache()
        if first is not None:
            raise first

    def path_counts(self) -> dict:
        """:attr:`counts` and any further counters the allocator keeps about its decisions (a copy;
        ``paged`` adds its placement searches); empty for an allocator with one path.
        Runtime complexity: O(paths)."""
        return dict(self.counts)

    def compiled_replay(self, events: ReplayArrays) -> CompiledReplay | None:
        """Replay ``events`` in compiled code, with exactly the state and figures that calling
        :meth:`allocate` and :meth:`free` event by event gives; None when this allocator has no
        compiled path (the replay then calls the protocol). Runtime complexity: O(events) in
        compiled code, plus the slow steps it hands back to Python (driver work)."""
        return None

    def _check(self) -> None:
        """Assert every invariant of the allocator; raises ``AssertionError`` naming the broken one.
        For tests and stress runs: runtime complexity O(live + cached blocks) or more (subclasses
        walk their pools and the driver's resources)."""
        assert self._allocated == sum(self._live.values()), "allocated bytes disagree with live allocations"

    # -- what subclasses provide ----------------------------------------------------------
    @abstractmethod
    def _allocate(self, size: int, stream: int) -> int: ...

    @abstractmethod
    def _free(self, addr: int) -> None: ...

    def __repr__(self) -> str:
        s = self.stats()
        return f"<{type(self).__name__} {self.name!r} live={s.allocated_count} reserved={s.reserved_bytes}>"
