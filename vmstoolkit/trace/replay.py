"""Replay a trace through any allocator and measure what it reserved.

The replay speaks only the allocator protocol (``allocate``, ``free``, ``stats``), so every
allocator, simulated or on a real GPU, is measured the same way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from vmstoolkit.errors import OutOfMemoryError, TraceFormatError
from vmstoolkit.pools.base import Allocator, ReplayArrays
from vmstoolkit.trace.events import Action, EventColumns, Trace


@dataclass
class ReplayResult:
    """Figures of one (trace, allocator) replay. Sizes in bytes."""

    trace: str
    allocator: str
    events: int
    peak_allocated: int
    peak_reserved: int
    oom: bool
    driver_calls: dict
    seconds: float
    oom_event: int | None = None
    oom_message: str = ""
    unmatched_frees: int = 0
    """Frees of memory allocated before recording began (matched to :attr:`Trace.preexisting`,
    or skipped when replay is told not to make it)."""
    device: int = 0
    preexisting_bytes: int = 0
    """Bytes live before recording began, allocated when the replay started."""
    settings_applied: str = ""
    """The recorded allocator settings the simulation was configured with (``config=``), if any."""
    skipped_events: int = 0
    """Corrupt events a lenient load left out."""
    extra: dict = field(default_factory=dict)
    timeline: dict | None = field(default=None, repr=False)

    @property
    def utilization(self) -> float:
        return self.peak_allocated / self.peak_reserved if self.peak_reserved else 1.0

    @property
    def fragmentation(self) -> float:
        return 1.0 - self.utilization

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        d.update(utilization=self.utilization, fragmentation=self.fragmentation,
                 events_per_second=self.events_per_second)
        return d


def replay(
    trace: Trace,
    allocator: Allocator,
    *,
    touch: bool = False,
    timeline: bool = False,
    check_every: int = 0,
    progress: Callable[[int], None] | None = None,
    progress_every: int = 2000,
    preexisting: bool = True,
    compiled: bool = True,
) -> ReplayResult:
    """Replay ``trace``'s allocs and completed frees through ``allocator``.

    - ``touch``: write every allocation once through the driver (``memset``), which on the
      simulated driver checks that the whole range is mapped and accessible;
    - ``timeline``: keep allocated and reserved bytes after each event (for figures);
    - ``check_every``: call ``allocator._check()`` every that many events (0: never);
    - ``progress``: called with the number of events done, every ``progress_every`` events.

    - ``preexisting``: first allocate the memory live before recording began
      (:attr:`Trace.preexisting`, from the loader), so its frees match and the peaks count it.

    The replay stops at the first out-of-memory and reports it (``oom``, ``oom_event``; an OOM
    while making the pre-existing memory is event 0). Frees of memory allocated before
    recording are counted in ``unmatched_frees`` (skipped when it was not made); a second free
    of an address the trace allocated and already freed is a corrupt trace
    (:class:`~vmstoolkit.errors.TraceFormatError`).

    - ``compiled``: let an allocator that has a compiled replay
      (:meth:`~vmstoolkit.pools.base.Allocator.compiled_replay`: ``paged``) run the events, with
      the same results to the byte, several times faster; ``touch`` and ``check_every`` need a
      Python step per event, so they replay through the protocol.
    """
    events = trace.alloc_free_events()
    addr_map: dict[int, int] = {}
    freed_at: dict[int, int] = {}  # trace address -> event index of its last free
    driver = allocator.driver
    n = len(events)
    allocated = np.zeros(n, dtype=np.int64) if timeline else None
    reserved = np.zeros(n, dtype=np.int64) if timeline else None
    unmatched = 0
    oom_event = None
    oom_message = ""
    done = 0
    alloc_action = Action.ALLOC
    pre_addrs: set[int] = set()
    pre_ptrs: list[int] = []
    pre_bytes = 0
    t0 = time.perf_counter()
    if preexisting:
        for e in trace.preexisting:
            try:
                addr_map[e.addr] = allocator.allocate(e.size, e.stream)
            except OutOfMemoryError as err:
                oom_event, oom_message = 0, f"while making the memory live before recording: {err}"
                events = []
                break
            pre_addrs.add(e.addr)
            pre_ptrs.append(addr_map[e.addr])
            pre_bytes += e.size
    run = None
    if compiled and events and not touch and not check_every:
        arrays = event_arrays(events, trace.preexisting[:len(pre_ptrs)], pre_ptrs, timeline, progress, progress_every)
        run = allocator.compiled_replay(arrays) if arrays is not None else None
    if run is not None:
        if run.double_free is not None:
            raise _double_free(trace, *run.double_free)
        done, unmatched, oom_event, oom_message = run.done, run.unmatched, run.oom_event, run.oom_message
        if timeline:
            allocated, reserved = run.allocated, run.reserved
    for i, e in enumerate(events if run is None else ()):  # the protocol, event by event
        if e.action is alloc_action:
            try:
                ptr = allocator.allocate(e.size, e.stream)
            except OutOfMemoryError as err:
                oom_event, oom_message = i, str(err)
                break
            addr_map[e.addr] = ptr
            freed_at.pop(e.addr, None)
            if touch:
                driver.memset(ptr, e.size)
        else:
            ptr = addr_map.pop(e.addr, None)
            if ptr is None:
                if e.addr in freed_at:
                    raise _double_free(trace, e.addr, i, freed_at[e.addr])
                unmatched += 1  # allocated before recording began
            else:
                allocator.free(ptr, e.stream)  # the stream the block was allocated on, as PyTorch records it
                freed_at[e.addr] = i
                if pre_addrs and e.addr in pre_addrs:
                    pre_addrs.discard(e.addr)
                    unmatched += 1  # allocated before recording began, made at the start
        done = i + 1
        if timeline:
            allocated[i] = allocator.allocated_bytes
            reserved[i] = driver.physical_bytes
        if check_every and done % check_every == 0:
            allocator._check()
        if progress is not None and done % progress_every == 0:
            progress(done)
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress(done)
    stats = allocator.stats()
    tl = None
    if timeline:
        times = events.time_us[:done].astype(np.int64) if isinstance(events, EventColumns) else \
            np.array([e.time_us for e in events[:done]], dtype=np.int64)
        tl = {"allocated": allocated[:done], "reserved": reserved[:done], "time_us": times}
    return ReplayResult(
        trace=trace.name, allocator=allocator.name, events=done,
        peak_allocated=stats.peak_allocated_bytes, peak_reserved=stats.peak_reserved_bytes,
        oom=oom_event is not None, oom_event=oom_event, oom_message=oom_message,
        driver_calls=stats.driver_calls, seconds=seconds, unmatched_frees=unmatched, timeline=tl,
        device=trace.device, preexisting_bytes=pre_bytes, skipped_events=sum(trace.skipped.values()),
    )


def _double_free(trace: Trace, addr: int, i: int, first: int) -> TraceFormatError:
    return TraceFormatError(f"{trace.name}: double free of address {addr:#x} at event {i} (already freed at event {first})")


def event_arrays(events: list, pre: tuple = (), pre_ptrs: list = (), timeline: bool = False,
                 progress: Callable[[int], None] | None = None, progress_every: int = 2000) -> ReplayArrays | None:
    """``events`` (:meth:`Trace.alloc_free_events`) and the pre-existing memory already made
    (``pre`` events at ``pre_ptrs``) as columns for
    :meth:`~vmstoolkit.pools.base.Allocator.compiled_replay`; None when a value does not fit an
    int64 (then the replay goes through the protocol). Cost: about 0.1 µs per event from a
    list; from :class:`~vmstoolkit.trace.events.EventColumns` (a loaded trace), the columns
    themselves: no Python per event."""
    alloc = Action.ALLOC
    if isinstance(events, EventColumns):
        pre_cols = event_arrays([], pre, pre_ptrs)
        return ReplayArrays(
            is_alloc=events.codes(alloc).astype(np.int8), addr=np.ascontiguousarray(events.addr, np.int64),
            size=np.ascontiguousarray(events.size, np.int64), stream=np.ascontiguousarray(events.stream, np.int64),
            pre_addr=pre_cols.pre_addr, pre_ptr=pre_cols.pre_ptr, pre_size=pre_cols.pre_size,
            pre_stream=pre_cols.pre_stream, timeline=timeline, progress=progress, progress_every=progress_every)
    try:
        return ReplayArrays(
            is_alloc=np.array([e.action is alloc for e in events], np.int8),
            addr=np.array([e.addr for e in events], np.int64), size=np.array([e.size for e in events], np.int64),
            stream=np.array([e.stream for e in events], np.int64),
            pre_addr=np.array([e.addr for e in pre], np.int64), pre_ptr=np.array(pre_ptrs, np.int64),
            pre_size=np.array([e.size for e in pre], np.int64), pre_stream=np.array([e.stream for e in pre], np.int64),
            timeline=timeline, progress=progress, progress_every=progress_every)
    except OverflowError:
        return None
