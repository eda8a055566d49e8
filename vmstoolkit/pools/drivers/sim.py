"""A simulated CUDA VMM driver: the same interface as the real one, checked like the real one.

It owns no memory. It tracks every physical handle, virtual reservation and mapping, enforces
the rules the CUDA driver enforces (aligned sizes, maps only inside reservations, no overlap,
unmap of whole mappings, no free of a mapped range, access only on mapped ranges), records which
handles are mapped in more than one range (aliases: the basis of stitching), bounds physical
memory by a capacity, and can be told to fail the N-th call of any operation.

>>> d = SimulatedDriver(capacity="8MiB")
>>> h = d.create(2 << 20); va = d.reserve(4 << 20)
>>> d.map(va, 2 << 20, h); d.map(va + (2 << 20), 2 << 20, h)  # one chunk, two places
>>> d.set_access(va, 4 << 20); d.aliases(h)
2
"""

from __future__ import annotations

from dataclasses import dataclass

from sortedcontainers import SortedDict

from vmstoolkit.errors import ConfigError, DriverError, DriverOutOfMemoryError
from vmstoolkit.pools.drivers.base import OPERATIONS, Handle, VMMDriver
from vmstoolkit.units import GiB, MiB, parse_size

DEFAULT_CAPACITY = 141 * GiB  # an H200
GRANULARITY = 2 * MiB  # what cuMemGetAllocationGranularity reports on the H200
VA_BASE = 0x7F00_0000_0000  # where simulated reservations start, as on a real Linux process


def _overlap(a: list, b: list) -> bool:
    return any(ka == kb and sa < eb and sb < ea for ka, sa, ea in a for kb, sb, eb in b)


@dataclass
class _Mapping:
    size: int
    handle: Handle
    offset: int
    accessible: bool = False


class SimulatedDriver(VMMDriver):
    """See the module docstring. ``capacity`` (bytes or ``"80GiB"``) bounds physical memory."""

    name = "sim"
    lists_resources = True

    def __init__(self, capacity: int | str | None = None, granularity: int = GRANULARITY) -> None:
        super().__init__()
        self._capacity = parse_size(capacity) if capacity is not None else DEFAULT_CAPACITY
        self._granularity = granularity
        self._faults: dict[str, dict[int, str]] = {}  # op -> {n: CUresult}
        # queued work (enqueue_use): (va, size, stream, seq, physical ranges) not yet finished
        self._queued: list[tuple[int, int, int, int, list]] = []
        self._seq = 0  # numbers every queued piece of work and every event, in queue order
        # event -> (stream, seq when recorded, what that stream was ordered after then: other -> seq)
        self._events: dict[int, tuple[int, int, dict[int, int]]] = {}
        self._next_event = 1
        self._ordered: dict[tuple[int, int], int] = {}  # (waiter, stream) -> seq the waiter waits for
        self.races: list[str] = []  # unordered cross-stream uses found by enqueue_use
        self.syncs = 0  # synchronize() calls
        self._init_memory()

    def _init_memory(self) -> None:
        """The book-keeping of handles, ranges, mappings and plain allocations (what
        :class:`~vmstoolkit.pools.drivers.compiled.CompiledSimulatedDriver` keeps in arrays)."""
        self._next_handle = 1
        self._next_va = VA_BASE
        self._released: set[Handle] = set()  # released but still mapped somewhere
        self._handle_maps: dict[Handle, set[int]] = {}  # handle -> VAs it is mapped at
        self._reservations: SortedDict = SortedDict()  # va -> size
        self._mappings: SortedDict = SortedDict()  # va -> _Mapping
        self._allocs: SortedDict = SortedDict()  # ptr -> size of plain allocations
        self._alloc_bytes = 0  # their sum (kept, not summed: every create and mem_alloc reads it)
        self._last_reservation = (0, 0)  # the range _reservation_of found last (most calls hit it again)
        self._sizes: dict[Handle, int] = {}  # every handle not yet freed, released ones included
        self._live_handle_bytes = 0  # bytes of handles not yet freed (released handles count until unmapped)

    # -- configuration ---------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        """The simulated granularity in bytes (2 MiB unless made otherwise). Cost: O(1)."""
        return self._granularity

    @property
    def capacity(self) -> int:
        """The simulated device's physical memory in bytes; :meth:`create` and :meth:`mem_alloc` past it
        fail with ``CUDA_ERROR_OUT_OF_MEMORY``. Cost: O(1)."""
        return self._capacity

    def fail_on(self, op: str, n: int, result: str | None = None) -> None:
        """Make the ``n``-th call (counting from 1, over the driver's life) of ``op`` fail; call
        it again for more faults (several calls of one operation, or several operations).

        ``result`` names the CUresult; the default is ``CUDA_ERROR_OUT_OF_MEMORY`` for
        ``create``/``mem_alloc``/``reserve`` and ``CUDA_ERROR_UNKNOWN`` otherwise.

        Cost: O(1); every later driver call checks its faults in O(1).
        """
        if op not in OPERATIONS:
            raise ConfigError(f"unknown driver operation {op!r}; one of {', '.join(OPERATIONS)}")
        if result is None:
            result = "CUDA_ERROR_OUT_OF_MEMORY" if op in ("create", "mem_alloc", "reserve") else "CUDA_ERROR_UNKNOWN"
        self._faults.setdefault(op, {})[n] = result

    def clear_faults(self) -> None:
        """Forget every fault :meth:`fail_on` planned. O(1)."""
        self._faults.clear()

    def _before(self, op: str, n: int) -> None:
        faults = self._faults.get(op)
        result = faults.get(n) if faults else None
        if result is not None:
            cls = DriverOutOfMemoryError if result == "CUDA_ERROR_OUT_OF_MEMORY" else DriverError
            raise cls(result, f"injected fault on call {n} of {op}")

    # -- physical memory -------------------------------------------------------------------
    def _in_use(self) -> int:
        return self._live_handle_bytes + self._alloc_bytes

    def _create(self, size: int) -> Handle:
        if self._in_use() + size > self._capacity:
            raise DriverOutOfMemoryError(
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"cuMemCreate of {size} bytes with {self._in_use()} of {self._capacity} in use")
        h = self._next_handle
        self._next_handle += 1
        self._handle_maps[h] = set()
        self._sizes[h] = size
        self._live_handle_bytes += size
        return h

    def _release(self, handle: Handle) -> None:
        if handle not in self._handle_maps or handle in self._released:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemRelease of unknown or released handle {handle}")
        if self._handle_maps[handle]:
            self._released.add(handle)  # freed when its last mapping goes, as in CUDA
        else:
            self._drop_handle(handle)

    def _drop_handle(self, handle: Handle) -> None:
        del self._handle_maps[handle]
        self._released.discard(handle)
        self._live_handle_bytes -= self._sizes.pop(handle)

    # -- virtual ranges --------------------------------------------------------------------
    def _reserve(self, size: int, alignment: int) -> int:
        align = max(alignment, self._granularity)
        va = -(-self._next_va // align) * align
        self._next_va = va + size
        self._reservations[va] = size
        return va

    def _reservation_of(self, va: int, size: int) -> tuple[int, int]:
        start, rsize = self._last_reservation
        if start <= va and va + size <= start + rsize:
            return start, rsize
        rsize = self._reservations.get(va)  # a range's own start (one range per mapping: native)
        if rsize is not None and size <= rsize:
            self._last_reservation = va, rsize
            return va, rsize
        i = self._reservations.bisect_right(va) - 1
        if i >= 0:
            start, rsize = self._reservations.peekitem(i)
            if start <= va and va + size <= start + rsize:
                self._last_reservation = start, rsize
                return start, rsize
        raise DriverError("CUDA_ERROR_INVALID_VALUE", f"range [{va:#x}, +{size}) is not inside one reserved range")

    def _free_address(self, va: int, size: int) -> None:
        if self._reservations.get(va) != size:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemAddressFree({va:#x}, {size}) does not match a reservation")
        if self._overlapping(va, size):
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemAddressFree({va:#x}, {size}) of a range that is still mapped")
        del self._reservations[va]
        if self._last_reservation[0] == va:
            self._last_reservation = (0, 0)

    def _overlapping(self, va: int, size: int) -> list[int]:
        """Start addresses of the mappings that overlap [va, va+size)."""
        m = self._mappings.get(va)
        if m is not None and m.size >= size:  # one mapping covers it: no other can overlap (the common case)
            return [va]
        # never index the keys by position: a SortedList rebuilds its positional index after every
        # insert or delete, O(mappings) per call (it was half of a vms replay's time)
        out = []
        start = next(self._mappings.irange(maximum=va, reverse=True), None)  # the last start <= va
        if start is not None and start + self._mappings[start].size > va:
            out.append(start)
        out.extend(self._mappings.irange(va, va + size, inclusive=(False, False)))
        return out

    def _map(self, va: int, size: int, handle: Handle, offset: int) -> None:
        g = self._granularity
        if va % g or size % g or offset % g or size <= 0:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemMap({va:#x}, {size}, offset={offset}) is not aligned to {g}")
        if handle not in self._handle_maps or handle in self._released:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemMap of unknown or released handle {handle}")
        if offset + size > self._sizes[handle]:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemMap of {size} bytes at offset {offset} of a {self._sizes[handle]}-byte handle")
        if offset or size != self._sizes[handle]:  # as the H200's driver answers (Note [whole handles])
            raise DriverError("CUDA_ERROR_NOT_SUPPORTED", f"cuMemMap of {size} bytes at offset {offset} of a "
                              f"{self._sizes[handle]}-byte handle: a handle is mapped only whole")
        self._reservation_of(va, size)
        if self._overlapping(va, size):
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemMap({va:#x}, {size}) overlaps an existing mapping")
        self._mappings[va] = _Mapping(size, handle, offset)
        self._handle_maps[handle].add(va)

    def _check_queued(self, va: int, size: int) -> None:
        """Refuse to unmap memory that queued work still uses (a real device would fault)."""
        for qva, qsize, _, _, _ in self._queued:
            if qva < va + size and va < qva + qsize:
                raise DriverError("CUDA_ERROR_ILLEGAL_ADDRESS",
                                  f"cuMemUnmap({va:#x}, {size}) while queued work still uses [{qva:#x}, +{qsize}): synchronize first")

    def _unmap(self, va: int, size: int) -> None:
        self._check_queued(va, size)
        starts = self._overlapping(va, size)
        covered = sum(self._mappings[s].size for s in starts)
        if not starts or starts[0] != va or covered != size:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemUnmap({va:#x}, {size}) does not cover whole mappings exactly")
        pos = va
        for s in starts:
            if s != pos:
                raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemUnmap({va:#x}, {size}) spans a hole at {pos:#x}")
            pos += self._mappings[s].size
        for s in starts:
            m = self._mappings.pop(s)
            maps = self._handle_maps[m.handle]
            maps.discard(s)
            if not maps and m.handle in self._released:
                self._drop_handle(m.handle)

    def _covered(self, va: int, size: int) -> list[_Mapping]:
        starts = self._overlapping(va, size)
        pos = va
        out = []
        for s in starts:
            m = self._mappings[s]
            if s > pos:
                break
            pos = max(pos, s + m.size)
            out.append(m)
        if pos < va + size:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"range [{va:#x}, +{size}) is not fully mapped (hole at {pos:#x})")
        return out

    def _set_access(self, va: int, size: int) -> None:
        for m in self._covered(va, size):
            m.accessible = True

    def _memset(self, va: int, size: int, value: int) -> None:
        i = self._allocs.bisect_right(va) - 1
        if i >= 0:
            ptr, asize = self._allocs.peekitem(i)
            if ptr <= va and va + size <= ptr + asize:
                return  # inside a plain allocation
        for m in self._covered(va, size):
            if not m.accessible:
                raise DriverError("CUDA_ERROR_ILLEGAL_ADDRESS", f"memset of [{va:#x}, +{size}) touches a mapping without access rights")

    # -- plain allocations -----------------------------------------------------------------
    def _mem_alloc(self, size: int) -> int:
        if self._in_use() + size > self._capacity:
            raise DriverOutOfMemoryError(
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"cuMemAlloc of {size} bytes with {self._in_use()} of {self._capacity} in use")
        va = -(-self._next_va // 512) * 512
        self._next_va = va + size
        self._allocs[va] = size
        self._alloc_bytes += size
        return va

    def _mem_free(self, ptr: int) -> None:
        if ptr not in self._allocs:
            raise DriverError("CUDA_ERROR_INVALID_VALUE", f"cuMemFree of unknown pointer {ptr:#x}")
        self._alloc_bytes -= self._allocs.pop(ptr)

    def _mem_info(self) -> tuple[int, int]:
        return self._capacity - self._in_use(), self._capacity

    def synchronize(self) -> None:
        """Waits for the queued work (:meth:`enqueue_use`); counted, since a sync stalls a real device.
        Cost: O(q) in pieces of queued work."""
        self.syncs += 1
        self._queued.clear()

    def enqueue_use(self, va: int, size: int, stream: int = 0) -> None:
        """Model a kernel queued on ``stream`` that will touch ``[va, va + size)`` later (as
        PyTorch frees a tensor while its last kernel is still queued): until it finishes
        (:meth:`finish` or :meth:`synchronize`), unmapping any of it fails, where a real device
        would fault in that kernel.

        The physical bytes behind the range are checked against the queued work of every other
        stream: touching bytes that such work still uses, with no :meth:`stream_wait` ordering
        this stream after it, is a race (the stream-ordered reuse contract broken); it is
        recorded in :attr:`races` and raised as ``CUDA_ERROR_ILLEGAL_ADDRESS``.

        Cost: O(log m + k + q * k * p) for k mappings under the range, q pieces of queued work
        and p physical pieces each (the pairwise overlap test)."""
        phys = self._physical(va, size)
        for qva, qsize, qstream, qseq, qphys in self._queued:
            if qstream == stream or self._ordered.get((stream, qstream), -1) >= qseq:
                continue
            if _overlap(phys, qphys):
                msg = (f"race: stream {stream:#x} touches [{va:#x}, +{size}) while work queued on stream "
                       f"{qstream:#x} still uses [{qva:#x}, +{qsize}) (same physical memory), with no wait between them")
                self.races.append(msg)
                raise DriverError("CUDA_ERROR_ILLEGAL_ADDRESS", msg)
        self._seq += 1
        self._queued.append((va, size, stream, self._seq, phys))

    def finish(self, stream: int | None = None) -> None:
        """The queued work of ``stream`` (every stream: None) has finished, and with it the work of
        other streams that ``stream`` was ordered after (it could not have finished first). Cost:
        O(q) in pieces of queued work."""
        if stream is None:
            self._queued = []
            return
        after = {o: q for (w, o), q in self._ordered.items() if w == stream}
        self._queued = [q for q in self._queued if q[2] != stream and q[3] > after.get(q[2], -1)]

    def _physical(self, va: int, size: int) -> list[tuple[object, int, int]]:
        """The physical bytes behind ``[va, va + size)``: (handle, start, end) pieces; plain
        allocations and unmapped addresses stand for themselves."""
        out = []
        for s in self._overlapping(va, size):
            m = self._mappings[s]
            lo, hi = max(va, s), min(va + size, s + m.size)
            out.append((m.handle, m.offset + lo - s, m.offset + hi - s))
        if not out:
            out.append(("va", va, va + size))
        return out

    def _record_event(self, stream: int) -> int:
        ev = self._next_event
        self._next_event += 1
        after = {o: q for (w, o), q in self._ordered.items() if w == stream}
        self._events[ev] = (stream, self._seq, after)
        return ev

    def _event_done(self, event: int) -> bool:
        stream, seq, _ = self._events[event]
        return not any(q[2] == stream and q[3] <= seq for q in self._queued)

    def _stream_wait(self, stream: int, event: int) -> None:
        # happens-before is transitive, as on a device: waiting for an event of ``other`` also
        # orders ``stream`` after whatever ``other`` was waiting for when the event was recorded
        other, seq, after = self._events[event]
        for o, q in ((other, seq), *after.items()):
            if o != stream and self._ordered.get((stream, o), -1) < q:
                self._ordered[(stream, o)] = q

    def _release_event(self, event: int) -> None:
        del self._events[event]

    # -- introspection (tests, invariants, leak checks) -----------------------------------
    def aliases(self, handle: Handle) -> int:
        """In how many virtual places ``handle`` is mapped now. Cost: O(1)."""
        return len(self._handle_maps.get(handle, ()))

    def live_handles(self) -> set[Handle]:
        """Handles created and not yet released. Cost: O(h) in handles not yet freed."""
        return set(self._handle_maps) - self._released

    def live_reservations(self) -> dict[int, int]:
        """address -> size of every live reservation (a copy). O(reservations)."""
        return dict(self._reservations)

    def live_mappings(self) -> dict[int, tuple[int, Handle]]:
        """va -> (size, handle) of every mapping (a new dict). Cost: O(m) in live mappings."""
        return {va: (m.size, m.handle) for va, m in self._mappings.items()}

    def live_allocs(self) -> dict[int, int]:
        """address -> size of every live :meth:`mem_alloc` allocation (a copy). O(allocations)."""
        return dict(self._allocs)

    def is_empty(self) -> bool:
        """True when nothing is created, reserved, mapped or allocated: nothing leaked. Cost: O(1)."""
        return not (self._handle_maps or self._reservations or self._mappings or self._allocs)

    def leak_report(self) -> str:
        """One line counting what is still alive (handles, those released but mapped, reservations,
        mappings, plain allocations), for a leak's error. O(1)."""
        return (f"{len(self._handle_maps)} handles ({len(self._released)} released but mapped), "
                f"{len(self._reservations)} reservations, {len(self._mappings)} mappings, "
                f"{len(self._allocs)} plain allocations")
