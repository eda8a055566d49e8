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
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

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
        """Peak allocated / peak reserved (1.0 when nothing was reserved)."""
        return self.peak_allocated_bytes / self.peak_reserved_bytes if self.peak_reserved_bytes else 1.0

    @property
    def fragmentation(self) -> float:
        return 1.0 - self.utilization

    def as_dict(self) -> dict:
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
        self._streams = DeferredFrees(driver, self._free, streams_apart=self.streams_apart)

    # -- the protocol ----------------------------------------------------------------------
    def allocate(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes for use on ``stream``; returns the device address.

        Raises :class:`~vmstoolkit.errors.InvalidSizeError` for a size of zero or below and
        :class:`~vmstoolkit.errors.OutOfMemoryError` when physical memory cannot serve it, even
        after waiting for every held free (see :mod:`~vmstoolkit.pools.streams`).
        """
        if self._closed:
            raise AllocatorClosedError(f"{self.name}: allocate({size!r}) after close(): the allocator is closed")
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidSizeError(f"allocation size must be an integer, got {size!r}")
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
        """
        if self._closed:
            raise AllocatorClosedError(f"{self.name}: free({addr!r:.60}) after close(): the allocator is closed")
        self._free_live(self._address(addr, "free"), stream)

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
        before that work, as queued up to the free, has finished (``Tensor.record_stream``)."""
        addr = self._address(addr, "record_stream")
        if addr not in self._live:
            raise InvalidFreeError(f"record_stream of address {addr:#x}, which is not a live allocation")
        self._streams.record(addr, stream, self._streams.own_stream(addr))

    def _address(self, addr, call: str) -> int:
        """``addr`` as an ``int`` (numpy's integers too), or the invalid-free error for a value that
        is no address (a float, a string, None, a bool), which the hex in later messages cannot format."""
        if isinstance(addr, bool) or not isinstance(addr, numbers.Integral):
            raise InvalidFreeError(f"{self.name}: {call} of {addr!r:.60}: an address is an integer")
        return int(addr)

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
        """Bytes of live requests now (cheap: no stats object)."""
        return self._allocated

    def size_of(self, addr: int) -> int:
        """The requested size of the live allocation at ``addr``."""
        addr = self._address(addr, "size_of")
        try:
            return self._live[addr]
        except KeyError:
            raise InvalidFreeError(f"no live allocation at address {addr:#x}") from None

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_bytes=self._allocated,
            peak_allocated_bytes=self._peak_allocated,
            allocated_count=len(self._live),
            peak_allocated_count=self._peak_count,
            reserved_bytes=self.driver.physical_bytes,
            peak_reserved_bytes=self.driver.peak_physical_bytes,
            total_allocs=self._total_allocs,
            total_frees=self._total_frees,
            total_allocated_bytes=self._total_bytes,
            num_ooms=self._num_ooms,
            driver_calls=dict(self.driver.calls),
        )

    def reset_peak_stats(self) -> None:
        self._peak_allocated = self._allocated
        self._peak_count = len(self._live)
        self.driver.reset_peak()

    def reset_accumulated_stats(self) -> None:
        """Zero the running totals (allocations, frees, bytes ever requested, out-of-memory count)."""
        self._total_allocs = self._total_frees = self._total_bytes = self._num_ooms = 0

    def _held_by_core(self) -> dict[int, int]:
        """address -> requested size of every block the core still holds as allocated: the live
        ones and the freed ones held for other streams' queued work (:mod:`~vmstoolkit.pools.streams`)."""
        return {**self._live, **self._streams.held()}

    def live_allocations(self) -> dict[int, int]:
        """address -> requested size of every live allocation (a copy)."""
        return dict(self._live)

    def empty_cache(self) -> None:
        """Give every cached byte that no live allocation uses back to the driver (after the
        device has finished the work queued on blocks freed by other streams)."""
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
        ``paged`` adds its placement searches); empty for an allocator with one path."""
        return dict(self.counts)

    def compiled_replay(self, events: ReplayArrays) -> CompiledReplay | None:
        """Replay ``events`` in compiled code, with exactly the state and figures that calling
        :meth:`allocate` and :meth:`free` event by event gives; None when this allocator has no
        compiled path (the replay then calls the protocol)."""
        return None

    def _check(self) -> None:
        """Assert every invariant of the allocator; raises ``AssertionError`` naming the broken one."""
        assert self._allocated == sum(self._live.values()), "allocated bytes disagree with live allocations"

    # -- what subclasses provide ----------------------------------------------------------
    @abstractmethod
    def _allocate(self, size: int, stream: int) -> int: ...

    @abstractmethod
    def _free(self, addr: int) -> None: ...

    def __repr__(self) -> str:
        s = self.stats()
        return f"<{type(self).__name__} {self.name!r} live={s.allocated_count} reserved={s.reserved_bytes}>"
