"""The VMM driver interface: the CUDA virtual-memory calls every pool is written against.

Two implementations speak it: :class:`~vmstoolkit.pools.drivers.sim.SimulatedDriver` (pure
Python, tracks every physical chunk, mapping and alias, injects faults) and
:class:`~vmstoolkit.pools.drivers.cuda.CudaDriver` (``cuda.bindings.driver``). Pools receive a
driver object and never import the real one; :func:`make_driver` is the one place that picks.

The public methods are a template: each counts the call in :attr:`VMMDriver.calls`, keeps the
physical-memory accounting (``physical_bytes`` and its peak, identical in both worlds) and
delegates to a ``_`` method of the implementation.

=================  ==========================  =======================================
method             CUDA driver call            meaning
=================  ==========================  =======================================
``create``         ``cuMemCreate``             a physical allocation (handle)
``release``        ``cuMemRelease``            drop the handle (memory goes once unmapped)
``reserve``        ``cuMemAddressReserve``     a virtual address range
``free_address``   ``cuMemAddressFree``        give the range back (must be unmapped)
``map``            ``cuMemMap``                map a handle into part of a reserved range
``unmap``          ``cuMemUnmap``              unmap whole mappings
``set_access``     ``cuMemSetAccess``          make a mapped range readable and writable
``mem_alloc``      ``cuMemAlloc``              a plain allocation (the non-VMM baselines)
``mem_free``       ``cuMemFree``
``memset``         ``cuMemsetD8``              touch memory (checks it is accessible)
``mem_info``       ``cuMemGetInfo``            (free, total) bytes of the device
``record_event``   ``cuEventRecord``           mark the work queued on a stream so far
``event_done``     ``cuEventQuery``            has that work finished?
``stream_wait``    ``cuStreamWaitEvent``       later work on a stream waits for an event
=================  ==========================  =======================================

Streams and events are what stream-ordered reuse needs (:mod:`vmstoolkit.pools.streams`): a
block freed by one stream is handed to another only once the first stream's queued work is
done, or behind a ``stream_wait``. Streams are the framework's handles as ints (0: the legacy
default stream); a driver without streams treats every event as done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from contextlib import nullcontext

from vmstoolkit.errors import InvalidSizeError

Handle = int
"""An opaque physical-allocation handle (``CUmemGenericAllocationHandle`` as an int)."""

OPERATIONS = (
    "create", "release", "reserve", "free_address", "map", "unmap", "set_access",
    "mem_alloc", "mem_free", "memset",
)


_UNBOUND = nullcontext()


class VMMDriver(ABC):
    """Abstract CUDA VMM driver. See the module docstring for the call table."""

    name: str = "abstract"
    lists_resources: bool = False
    """True when the driver can list every live handle, mapping and reservation
    (:meth:`live_handles`, :meth:`live_mappings`, :meth:`live_reservations`): the simulated
    driver. Allocators' ``_check`` then also proves they own exactly what the driver holds."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._handle_sizes: dict[Handle, int] = {}
        self._alloc_sizes: dict[int, int] = {}
        self.physical_bytes = 0
        self.peak_physical_bytes = 0

    # -- properties every implementation provides ------------------------------------------
    @property
    @abstractmethod
    def granularity(self) -> int:
        """Minimum (and recommended) granularity of physical allocations, in bytes. Cost: O(1); no
        driver call (the real driver asks once, when made)."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Total physical bytes of the device. Cost: O(1); no driver call (asked once, when made)."""

    # -- the template ----------------------------------------------------------------------
    def _count(self, op: str) -> None:
        n = self.calls[op] + 1
        self.calls[op] = n
        self._before(op, n)

    def _before(self, op: str, n: int) -> None:
        """Hook run before the ``n``-th call of ``op`` (the simulated driver injects faults)."""

    def _grow(self, nbytes: int) -> None:
        self.physical_bytes += nbytes
        if self.physical_bytes > self.peak_physical_bytes:
            self.peak_physical_bytes = self.physical_bytes

    def create(self, size: int) -> Handle:
        """Allocate ``size`` bytes of physical memory (a multiple of :attr:`granularity`).
        Cost: O(1); one driver call (``cuMemCreate``), and on the real driver a ``cuMemGetInfo``
        too when it raises ``peak_physical_bytes``."""
        if size <= 0 or size % self.granularity:
            raise InvalidSizeError(f"physical allocation size {size} is not a positive multiple of the granularity {self.granularity}")
        self._count("create")
        handle = self._create(size)
        self._handle_sizes[handle] = size
        self._grow(size)
        return handle

    def release(self, handle: Handle) -> None:
        """``cuMemRelease``: give back ``handle``'s physical memory (kept by CUDA until its last mapping is
        unmapped); counted, and ``physical_bytes`` lowered. Cost: O(1); one driver call."""
        self._count("release")
        self._release(handle)
        self.physical_bytes -= self._handle_sizes.pop(handle)

    def reserve(self, size: int, alignment: int = 0) -> int:
        """``cuMemAddressReserve``: a virtual range of ``size`` bytes (a positive multiple of the
        granularity, else :class:`~vmstoolkit.errors.InvalidSizeError`), aligned to ``alignment`` (0:
        the granularity); returns its address. Cost: O(1) here (the simulated driver: O(log r) in
        live reservations r); one driver call."""
        if size <= 0 or size % self.granularity:
            raise InvalidSizeError(f"virtual range size {size} is not a positive multiple of the granularity {self.granularity}")
        self._count("reserve")
        return self._reserve(size, alignment)

    def free_address(self, va: int, size: int) -> None:
        """``cuMemAddressFree``: give back the virtual range of ``size`` bytes at ``va`` (nothing may be
        mapped in it). Cost: O(1) here (the simulated driver: O(log r + log m) in reservations r and
        mappings m, to check it); one driver call."""
        self._count("free_address")
        self._free_address(va, size)

    def map(self, va: int, size: int, handle: Handle, offset: int = 0) -> None:
        """``cuMemMap``: map ``size`` bytes of ``handle``, from ``offset``, at ``va`` inside a reservation.
        Cost: O(1) here (the simulated driver: O(log m) in live mappings m, to find overlaps); one
        driver call."""
        self._count("map")
        self._map(va, size, handle, offset)

    def create_mapped(self, va: int, size: int, count: int, tx) -> list[Handle]:
        """``count`` new handles of ``size`` bytes, the ``i``-th mapped at ``va + i * size``
        right after it is made: :meth:`create` then :meth:`map`, chunk by chunk, counted and
        failing exactly as those calls would. Each step that succeeds registers its undo on the
        transaction ``tx`` (:class:`~vmstoolkit.pools.drivers.txn.Transaction`) at once,
        ``("release", h, size)`` then ``("unmap", va + i * size, size)``, so a failure leaves
        ``tx`` holding the undo of exactly what was done. Returns the handles in address order.

        One call where a pool would make ``2 * count``: the compiled simulated driver runs them
        in one compiled loop (:class:`~vmstoolkit.pools.drivers.compiled.CompiledSimulatedDriver`).
        Runtime complexity: ``count`` creates and maps."""
        handles = []
        for i in range(count):
            h = self.create(size)
            tx.undo("release", h, size)
            self.map(va + i * size, size, h)
            tx.undo("unmap", va + i * size, size)
            handles.append(h)
        return handles

    def map_many(self, va: int, size: int, handles: list[Handle], tx) -> None:
        """Map ``handles[i]`` (whole, ``size`` bytes each) at ``va + i * size`` in order:
        :meth:`map` per handle, counted and failing as those calls would, each success
        registering ``("unmap", va + i * size, size)`` on ``tx``. Runtime complexity:
        ``len(handles)`` maps."""
        for i, h in enumerate(handles):
            self.map(va + i * size, size, h)
            tx.undo("unmap", va + i * size, size)

    def unmap(self, va: int, size: int) -> None:
        """``cuMemUnmap``: unmap the whole mapping(s) covering ``size`` bytes at ``va``. Cost: O(1)
        here (the simulated driver: O(q + k log m) for k mappings covered, q pieces of queued work,
        m live mappings); one driver call."""
        self._count("unmap")
        self._unmap(va, size)

    def set_access(self, va: int, size: int) -> None:
        """``cuMemSetAccess``: make ``size`` mapped bytes at ``va`` readable and writable from the
        device (and the peers the driver was made with). Cost: O(1) here (the simulated driver:
        O(k + log m) for k mappings covered); one driver call, however many mappings it covers."""
        self._count("set_access")
        self._set_access(va, size)

    def mem_alloc(self, size: int) -> int:
        """``cuMemAlloc`` (what ``cudaMalloc`` does), for the non-VMM baselines: ``size`` bytes (positive,
        else :class:`~vmstoolkit.errors.InvalidSizeError`); returns the address, counted in
        ``physical_bytes``. Cost: O(1) (the simulated driver: O(log a) in plain allocations a); one
        driver call, and on the real driver a ``cuMemGetInfo`` too when it raises the peak."""
        if size <= 0:
            raise InvalidSizeError(f"allocation size must be positive, got {size}")
        self._count("mem_alloc")
        ptr = self._mem_alloc(size)
        self._alloc_sizes[ptr] = size
        self._grow(size)
        return ptr

    def mem_free(self, ptr: int) -> None:
        """``cuMemFree`` of an address :meth:`mem_alloc` returned; ``physical_bytes`` lowered. Cost:
        O(1) (the simulated driver: O(log a)); one driver call, which on a real device may wait for
        queued work as ``cudaFree`` does."""
        self._count("mem_free")
        self._mem_free(ptr)
        self.physical_bytes -= self._alloc_sizes.pop(ptr)

    def memset(self, va: int, size: int, value: int = 0) -> None:
        """``cuMemsetD8``: set ``size`` bytes at ``va`` to ``value`` (the range must be mapped and
        accessible). Cost: O(1) here (the simulated driver: O(log a + k + log m) to check the range);
        one driver call, queued on the default stream."""
        self._count("memset")
        self._memset(va, size, value)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory as the device reports them. Cost: O(1); one driver
        call (``cuMemGetInfo``), not counted in :attr:`calls`."""
        return self._mem_info()

    def reset_peak(self) -> None:
        """Start ``peak_physical_bytes`` again from ``physical_bytes``. No driver call; O(1)."""
        self.peak_physical_bytes = self.physical_bytes

    def replay_extra(self) -> dict:
        """What the device itself says about a replay run on it, for ``ReplayResult.extra``
        (the real driver: memory in use at the peak and the device's name); nothing by default.
        Cost: O(1); no driver call here (the real driver: one ``cuDeviceGetName``)."""
        return {}

    def live_handles(self) -> set[Handle]:
        """Every physical handle alive now (only where :attr:`lists_resources`). Cost: O(live
        handles) where supported; no driver call."""
        raise NotImplementedError(f"the {self.name} driver cannot list its handles (lists_resources is False)")

    def live_mappings(self) -> dict[int, tuple[int, Handle]]:
        """Every mapping alive now, ``va -> (size, handle)`` (only where :attr:`lists_resources`).
        Cost: O(live mappings) where supported; no driver call."""
        raise NotImplementedError(f"the {self.name} driver cannot list its mappings (lists_resources is False)")

    def live_reservations(self) -> dict[int, int]:
        """Every reserved virtual range alive now, ``va -> size`` (only where :attr:`lists_resources`).
        Cost: O(live reservations) where supported; no driver call."""
        raise NotImplementedError(f"the {self.name} driver cannot list its reservations (lists_resources is False)")

    def synchronize(self) -> None:
        """Wait for outstanding device work (no-op where there is none). Cost: O(1) here; the real
        driver makes one ``cuCtxSynchronize``, which blocks the host until the device is idle."""

    # -- streams and events ----------------------------------------------------------------
    def record_event(self, stream: int) -> int:
        """An event that completes once the work queued on ``stream`` so far has finished. Cost:
        O(1); the real driver makes one ``cuEventRecord`` (and a ``cuEventCreate`` when no spare
        event is left); the host never waits."""
        self.calls["record_event"] += 1
        return self._record_event(stream)

    def event_done(self, event: int) -> bool:
        """Whether the work before ``event`` has finished (never blocks). Cost: O(1) here (the
        simulated driver: O(q) in pieces of queued work); the real driver makes one ``cuEventQuery``."""
        return self._event_done(event)

    def stream_wait(self, stream: int, event: int) -> None:
        """Make every later piece of work on ``stream`` wait for ``event`` (the host never waits).
        Cost: O(1); the real driver makes one ``cuStreamWaitEvent``."""
        self.calls["stream_wait"] += 1
        self._stream_wait(stream, event)

    def release_event(self, event: int) -> None:
        """Give ``event`` back (it may still be waited on by queued work). Cost: O(1); no driver call
        (the real driver keeps the event for reuse)."""
        self._release_event(event)

    def _record_event(self, stream: int) -> int:
        return 0

    def _event_done(self, event: int) -> bool:
        return True

    def _stream_wait(self, stream: int, event: int) -> None:
        pass

    def _release_event(self, event: int) -> None:
        pass

    def bound(self):
        """A context manager: the driver's context is current on the calling thread inside it
        (every call binds it anyway; binding once around many calls saves the checks). The
        simulated driver has no contexts. Cost: O(1); entering it on the real driver makes one
        ``cuCtxGetCurrent``, plus a ``cuCtxPushCurrent``/``cuCtxPopCurrent`` pair when another
        context is current (nested entries make none)."""
        return _UNBOUND

    def close(self) -> None:
        """Give back driver resources (contexts); allocations must be released first. Cost: O(1); the
        real driver makes one ``cuDevicePrimaryCtxRelease``."""

    # -- what implementations provide ------------------------------------------------------
    @abstractmethod
    def _create(self, size: int) -> Handle: ...
    @abstractmethod
    def _release(self, handle: Handle) -> None: ...
    @abstractmethod
    def _reserve(self, size: int, alignment: int) -> int: ...
    @abstractmethod
    def _free_address(self, va: int, size: int) -> None: ...
    @abstractmethod
    def _map(self, va: int, size: int, handle: Handle, offset: int) -> None: ...
    @abstractmethod
    def _unmap(self, va: int, size: int) -> None: ...
    @abstractmethod
    def _set_access(self, va: int, size: int) -> None: ...
    @abstractmethod
    def _mem_alloc(self, size: int) -> int: ...
    @abstractmethod
    def _mem_free(self, ptr: int) -> None: ...
    @abstractmethod
    def _memset(self, va: int, size: int, value: int) -> None: ...
    @abstractmethod
    def _mem_info(self) -> tuple[int, int]: ...

