"""Adaptors: wrappers that take any allocator and speak the same protocol.

As RMM's resource adaptors (``LimitingResourceAdaptor``, ``StatisticsResourceAdaptor``,
``LoggingResourceAdaptor``) wrap any memory resource, these wrap any
:class:`~vmstoolkit.pools.base.Allocator`, the upstream, given first, and are allocators
themselves, so they compose and go wherever an allocator goes (replay, the bridges)::

    vms = make_allocator("vms")
    a = LimitingAdaptor(StatisticsAdaptor(vms), "8GiB")
    p = a.allocate(3 << 20, stream=0)
    a.upstream.statistics().peak_bytes    # 3145728

- :class:`LimitingAdaptor`: at most ``limit`` bytes allocated through it; a request beyond
  raises :class:`~vmstoolkit.errors.OutOfMemoryError` with the figures;
- :class:`StatisticsAdaptor`: current, peak and total bytes and counts, per size class (PyTorch's
  small and large pools) and per stream, with a push/pop stack of counters;
- :class:`SnapshotLoggingAdaptor`: every allocation and free written to a :class:`SnapshotLog`
  in PyTorch's memory-snapshot format, which :func:`vmstoolkit.trace.loader.load_trace` reads
  back (the PyTorch handle's ``record_history()`` / ``dump_snapshot()``).

Opt-in, never a default layer: nothing is wrapped unless asked, and each adaptor costs one more
Python call per allocation and free. What the adaptors must see, they see only through the
protocol: a wrapped allocator replays event by event (:meth:`AllocatorAdaptor.compiled_replay`
is None) and is served to PyTorch through callbacks (no compiled hook).

The bookkeeping (live allocations, peaks, held frees) stays the upstream's: an adaptor keeps only
what it adds.
"""

from __future__ import annotations

import gzip
import pickle
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from vmstoolkit.errors import ConfigError, OutOfMemoryError
from vmstoolkit.pools.base import Allocator, AllocatorStats
from vmstoolkit.pools.constants import SMALL_SIZE
from vmstoolkit.units import format_size, parse_size

SMALL_POOL_MAX = SMALL_SIZE
"""Requests up to this size count in the ``small_pool`` statistics, larger ones in ``large_pool``:
PyTorch's caching allocator's boundary (``kSmallSize``), so ``memory_stats()`` reads alike."""


class AllocatorAdaptor(Allocator):
    """Base of every adaptor: an allocator that serves every call from ``upstream``.

    Each protocol method forwards to the upstream; subclasses override the ones they add to, and
    see every completed free through :meth:`_freed`.
    ``name``, ``driver``, ``counts`` and ``streams_apart`` are the upstream's, so results read the
    same wrapped or not. :meth:`compiled_replay` is None (an adaptor sees every call) and
    ``compiled_hook`` is None (PyTorch reaches it through callbacks).
    """

    compiled_hook = None

    def __init__(self, upstream: Allocator) -> None:
        # Not Allocator.__init__: the bookkeeping (live allocations, peaks, held frees) is the upstream's.
        self.upstream = upstream
        self.driver = upstream.driver

    @property
    def name(self) -> str:
        """The upstream's registry name. Runtime complexity: O(1) per adaptor in the chain."""
        return self.upstream.name

    @property
    def streams_apart(self) -> bool:
        """The upstream's :attr:`Allocator.streams_apart`. Runtime complexity: O(1) per adaptor in the
        chain."""
        return self.upstream.streams_apart

    @property
    def counts(self) -> Mapping[str, int]:
        """The upstream's :attr:`Allocator.counts` (the paths that served its requests). Runtime
        complexity: O(1) per adaptor in the chain."""
        return self.upstream.counts

    def path_counts(self) -> dict:
        """The upstream's :meth:`Allocator.path_counts`. Runtime complexity: the upstream's, O(paths)."""
        return self.upstream.path_counts()

    # -- the protocol, forwarded --------------------------------------------------------------
    def allocate(self, size: int, stream: int = 0) -> int:
        """:meth:`Allocator.allocate`, forwarded (subclasses count or check first). Runtime complexity: the
        upstream's allocate plus O(1)."""
        return self.upstream.allocate(size, stream)

    def free(self, addr: int, stream: int | None = None) -> None:
        """:meth:`Allocator.free`, forwarded; the adaptor's own bookkeeping runs even when the upstream's
        driver teardown fails (the allocation is gone either way). Runtime complexity: the upstream's
        free plus one size lookup, O(1)."""
        size = self.upstream.size_of(addr)  # raises for an address nothing lives at, as free would
        try:
            self.upstream.free(addr, stream)  # a live address: gone afterwards, even on a DriverError
        finally:
            self._freed(addr, size, stream)

    def _freed(self, addr: int, size: int, stream: int | None) -> None:
        """The live allocation at ``addr`` of ``size`` bytes was freed upstream (subclasses)."""

    def record_stream(self, addr: int, stream: int) -> None:
        """:meth:`Allocator.record_stream`, forwarded. Runtime complexity: O(1)."""
        self.upstream.record_stream(addr, stream)

    @property
    def allocated_bytes(self) -> int:
        """The upstream's live requested bytes. Runtime complexity: O(1)."""
        return self.upstream.allocated_bytes

    def size_of(self, addr: int) -> int:
        """The upstream's :meth:`Allocator.size_of`. Runtime complexity: O(1)."""
        return self.upstream.size_of(addr)

    def stats(self) -> AllocatorStats:
        """The upstream's :meth:`Allocator.stats` (subclasses add their own figures). Runtime complexity:
        the upstream's, O(driver operations)."""
        return self.upstream.stats()

    def reset_peak_stats(self) -> None:
        """The upstream's :meth:`Allocator.reset_peak_stats`. Runtime complexity: O(1)."""
        self.upstream.reset_peak_stats()

    def reset_accumulated_stats(self) -> None:
        """The upstream's :meth:`Allocator.reset_accumulated_stats`. Runtime complexity: O(1)."""
        self.upstream.reset_accumulated_stats()

    def live_allocations(self) -> dict[int, int]:
        """The upstream's live allocations (a copy). Runtime complexity: O(live)."""
        return self.upstream.live_allocations()

    def _held_by_core(self) -> dict[int, int]:
        return self.upstream._held_by_core()

    def empty_cache(self) -> None:
        """The upstream's :meth:`Allocator.empty_cache`. Runtime complexity: the upstream's, O(cached
        blocks) and their driver calls."""
        self.upstream.empty_cache()

    def close(self) -> None:
        """Closes the upstream (:meth:`Allocator.close`). Runtime complexity: the upstream's, O(live) frees
        then :meth:`empty_cache`."""
        self.upstream.close()

    # The compiled-path bookkeeping (Allocator.export_counters ... note_oom) is the upstream's: an
    # adaptor runs no compiled path itself (compiled_replay is None), so these only ever reach the
    # counters the upstream keeps.
    def export_counters(self):
        """The upstream's :meth:`Allocator.export_counters`. Runtime complexity: O(1)."""
        return self.upstream.export_counters()

    def stream_home(self):
        """The upstream's :meth:`Allocator.stream_home`. Runtime complexity: O(1)."""
        return self.upstream.stream_home()

    def block_streams(self):
        """The upstream's :meth:`Allocator.block_streams`. Runtime complexity: O(such blocks)."""
        return self.upstream.block_streams()

    def report_compiled(self, counters, **state) -> None:
        """The upstream's :meth:`Allocator.report_compiled`. Runtime complexity: O(live + freed)."""
        self.upstream.report_compiled(counters, **state)

    def note_oom(self) -> None:
        """The upstream's :meth:`Allocator.note_oom`. Runtime complexity: O(1)."""
        self.upstream.note_oom()

    def stats_of(self, counters):
        """The upstream's :meth:`Allocator.stats_of`. Runtime complexity: O(driver operations)."""
        return self.upstream.stats_of(counters)

    def reset_peaks_of(self, counters) -> None:
        """The upstream's :meth:`Allocator.reset_peaks_of`. Runtime complexity: O(1)."""
        self.upstream.reset_peaks_of(counters)

    def reset_totals_of(self, counters) -> None:
        """The upstream's :meth:`Allocator.reset_totals_of`. Runtime complexity: O(1)."""
        self.upstream.reset_totals_of(counters)

    def compiled_replay(self, events) -> None:
        """None: an adaptor's figures need every request through Python, so a replay calls the protocol.
        Runtime complexity: O(1)."""
        return None

    def _check(self) -> None:
        self.upstream._check()

    # Allocator's abstract steps: never reached through an adaptor (allocate and free forward).
    def _allocate(self, size: int, stream: int) -> int:
        return self.upstream.allocate(size, stream)

    def _free(self, addr: int) -> None:
        self.upstream.free(addr)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} over {self.upstream!r}>"


def unwrap(allocator: Allocator, adaptor: AllocatorAdaptor) -> Allocator:
    """``allocator`` with ``adaptor`` taken out of its chain of adaptors (the chain's outermost
    allocator, which is ``adaptor.upstream`` when ``adaptor`` was outermost). Cost: the chain's length.

    >>> from vmstoolkit.pools import make_allocator
    >>> a = make_allocator("native"); s = StatisticsAdaptor(a); lim = LimitingAdaptor(s, 1 << 30)
    >>> unwrap(lim, s).upstream is a
    True
    """
    if allocator is adaptor:
        return adaptor.upstream
    outer = allocator
    while isinstance(outer, AllocatorAdaptor):
        if outer.upstream is adaptor:
            outer.upstream = adaptor.upstream
            return allocator
        outer = outer.upstream
    raise ConfigError(f"{adaptor!r} is not in the chain of {allocator!r}")


# -- limits ---------------------------------------------------------------------------------
class LimitingAdaptor(AllocatorAdaptor):
    """At most ``limit`` bytes (an int or ``"8GiB"``) of live requests through this adaptor.

    A request that would pass it raises :class:`~vmstoolkit.errors.OutOfMemoryError` (``requested``,
    ``limit``, ``reserved``: the upstream's physical bytes) before the upstream is asked, and counts
    in ``stats().num_ooms``; the frees that follow make room again. RMM's
    ``LimitingResourceAdaptor``, counting requested bytes (no alignment). Cost: one dict lookup
    per free (the size, from the upstream).
    """

    def __init__(self, upstream: Allocator, limit: int | str, why: str = "") -> None:
        super().__init__(upstream)
        self.limit = parse_size(limit)
        if self.limit <= 0:
            raise ConfigError(f"limit must be a positive size, got {limit!r}")
        self.why = why  # what set the limit, for the error (e.g. "set_per_process_memory_fraction(0.05)")
        self._allocated = upstream.allocated_bytes  # allocations made before wrapping count, and their frees
        self._refused = 0

    @property
    def allocated_through(self) -> int:
        """Bytes of live requests made through this adaptor (RMM's ``get_allocated_bytes``). Runtime
        complexity: O(1); the upstream is not asked."""
        return self._allocated

    def allocate(self, size: int, stream: int = 0) -> int:
        """:meth:`Allocator.allocate`, refused with an :class:`~vmstoolkit.errors.OutOfMemoryError`
        carrying the figures when it would take the bytes allocated through this adaptor past the limit
        (counted in ``num_ooms``). Runtime complexity: O(1) plus the upstream's allocate."""
        if isinstance(size, int) and self._allocated + size > self.limit:
            self._refused += 1
            raise past_limit(self.name, size, self._allocated, self.limit, self.driver, self.why)
        addr = self.upstream.allocate(size, stream)
        self._allocated += size
        return addr

    def _freed(self, addr: int, size: int, stream: int | None) -> None:
        self._allocated -= size

    def stats(self) -> AllocatorStats:
        """The upstream's statistics, with the refusals added to ``num_ooms``. Runtime complexity: the
        upstream's, O(driver operations)."""
        s = self.upstream.stats()
        s.num_ooms += self._refused
        return s

    def reset_accumulated_stats(self) -> None:
        """The upstream's reset, and the refusal count zeroed. Runtime complexity: O(1)."""
        self.upstream.reset_accumulated_stats()
        self._refused = 0

    def _check(self) -> None:
        super()._check()
        assert 0 <= self._allocated <= self.limit, f"{self._allocated} bytes allocated through a limit of {self.limit}"


def past_limit(name: str, size: int, allocated: int, limit: int, driver, why: str = "") -> OutOfMemoryError:
    """The error for a request of ``size`` bytes that would take ``allocated`` past ``limit``
    (:class:`LimitingAdaptor`'s, and the compiled ``paged`` hook's under a memory fraction).
    Cost: O(1); no driver call (reads the driver's counters)."""
    by = f" set by {why}" if why else ""
    return OutOfMemoryError(
        f"{name}: out of memory: a request of {size} bytes ({format_size(size)}) with {allocated} bytes allocated "
        f"would pass the limit of {limit} bytes ({format_size(limit)}){by}",
        requested=size, reserved=driver.physical_bytes, capacity=driver.capacity, limit=limit)


# -- statistics -------------------------------------------------------------------------------
@dataclass
class Statistics:
    """Counters of allocations, RMM's ``Statistics``: bytes and counts now, at their peak, in total."""

    current_bytes: int = 0
    current_count: int = 0
    peak_bytes: int = 0
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0

    def add(self, size: int) -> None:
        """Count one allocation of ``size`` bytes (current, peak and total). Runtime complexity: O(1)."""
        self.current_bytes += size
        self.current_count += 1
        self.total_bytes += size
        self.total_count += 1
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        if self.current_count > self.peak_count:
            self.peak_count = self.current_count

    def sub(self, size: int) -> None:
        """Count the free of a ``size``-byte allocation. Runtime complexity: O(1)."""
        self.current_bytes -= size
        self.current_count -= 1

    def merged(self, inner: "Statistics") -> "Statistics":
        """These counters with those of a nested scope added (RMM's ``pop_counters``): its
        peak counts on top of what was current when it began. Runtime complexity: O(1)."""
        return Statistics(
            current_bytes=self.current_bytes + inner.current_bytes, current_count=self.current_count + inner.current_count,
            peak_bytes=max(self.peak_bytes, self.current_bytes + inner.peak_bytes),
            peak_count=max(self.peak_count, self.current_count + inner.peak_count),
            total_bytes=self.total_bytes + inner.total_bytes, total_count=self.total_count + inner.total_count)

    def as_pool(self) -> dict:
        """The figures under the names of :attr:`AllocatorStats.pools`. Runtime complexity: O(1)."""
        d = asdict(self)
        d["freed_bytes"] = self.total_bytes - self.current_bytes
        d["freed_count"] = self.total_count - self.current_count
        return d


@dataclass
class _Frame:
    """One level of the counter stack: everything, per size class, per stream."""

    all: Statistics = field(default_factory=Statistics)
    pools: dict[str, Statistics] = field(default_factory=lambda: {"small_pool": Statistics(), "large_pool": Statistics()})
    streams: dict[int, Statistics] = field(default_factory=dict)

    def merged(self, inner: "_Frame") -> "_Frame":
        streams = dict(self.streams)
        for s, st in inner.streams.items():
            streams[s] = streams.get(s, Statistics()).merged(st)
        return _Frame(self.all.merged(inner.all), {k: v.merged(inner.pools[k]) for k, v in self.pools.items()}, streams)


class StatisticsAdaptor(AllocatorAdaptor):
    """Counts every allocation and free through it: all of them, per size class (``small_pool``:
    requests up to :data:`SMALL_POOL_MAX`, ``large_pool``), and per stream (a free counts against
    the stream its allocation was made on). Allocations made before it wrapped the allocator are
    not counted, nor are their frees.

    :meth:`push_counters` starts a nested scope with zeroed counters, :meth:`pop_counters` ends it
    and adds its figures to the scope around it, as RMM's statistics stack does (``with
    a.counting() as scope:``). :meth:`stats` reports the per-size-class figures of the whole run in
    :attr:`AllocatorStats.pools`, which :func:`vmstoolkit.integrations.bridge.torch_stats` turns into
    PyTorch's ``small_pool``/``large_pool`` statistics. Cost: a dict insert and a few counter
    updates per call.
    """

    def __init__(self, upstream: Allocator) -> None:
        super().__init__(upstream)
        self._stack: list[_Frame] = [_Frame()]
        self._allocs: dict[int, tuple[int, int]] = {}  # address -> (size, stream)

    def allocate(self, size: int, stream: int = 0) -> int:
        """:meth:`Allocator.allocate`, counted in the innermost scope by size class (small pool up to 1
        MiB, large above) and by stream. Runtime complexity: O(1) plus the upstream's allocate."""
        addr = self.upstream.allocate(size, stream)
        self._allocs[addr] = (size, stream)
        top = self._stack[-1]
        top.all.add(size)
        top.pools["small_pool" if size <= SMALL_POOL_MAX else "large_pool"].add(size)
        st = top.streams.get(stream)
        if st is None:
            st = top.streams[stream] = Statistics()
        st.add(size)
        return addr

    def _freed(self, addr: int, size: int, stream: int | None) -> None:
        seen = self._allocs.pop(addr, None)
        if seen is None:  # allocated before this adaptor wrapped the allocator: never counted
            return
        size, own = seen
        top = self._stack[-1]
        top.all.sub(size)
        top.pools["small_pool" if size <= SMALL_POOL_MAX else "large_pool"].sub(size)
        top.streams.setdefault(own, Statistics()).sub(size)

    # -- the counters -------------------------------------------------------------------------
    def statistics(self) -> Statistics:
        """The innermost scope's counters (RMM's ``allocation_counts``): a copy. Runtime complexity: O(1)."""
        return Statistics(**asdict(self._stack[-1].all))

    def pool_statistics(self) -> dict[str, Statistics]:
        """The innermost scope's counters per size class (``small_pool``, ``large_pool``), copies.
        Runtime complexity: O(1) (two classes)."""
        return {k: Statistics(**asdict(v)) for k, v in self._stack[-1].pools.items()}

    def stream_statistics(self) -> dict[int, Statistics]:
        """The innermost scope's counters per stream, copies. Runtime complexity: O(streams seen in it)."""
        return {k: Statistics(**asdict(v)) for k, v in self._stack[-1].streams.items()}

    def push_counters(self) -> Statistics:
        """Start a nested scope with zeroed counters; returns the counters of the scope it nests in.
        Runtime complexity: O(1)."""
        outer = self.statistics()
        self._stack.append(_Frame())
        return outer

    def pop_counters(self) -> Statistics:
        """End the innermost scope, add its figures to the one around it, and return its counters.
        Runtime complexity: O(streams of the two scopes)."""
        if len(self._stack) == 1:
            raise ConfigError("pop_counters without a push_counters: the outermost counters cannot be popped")
        inner = self._stack.pop()
        self._stack[-1] = self._stack[-1].merged(inner)
        return inner.all

    @contextmanager
    def counting(self) -> Iterator[Statistics]:
        """``with a.counting() as scope:`` counts the block's allocations on their own; ``scope``
        holds its counters once the block ends. Runtime complexity: O(1) on entry, O(streams) on
        exit (:meth:`pop_counters`)."""
        self.push_counters()
        scope = Statistics()
        try:
            yield scope
        finally:
            for k, v in asdict(self.pop_counters()).items():
                setattr(scope, k, v)

    def _whole_run(self) -> _Frame:
        frame = self._stack[0]
        for inner in self._stack[1:]:
            frame = frame.merged(inner)
        return frame

    def stats(self) -> AllocatorStats:
        """The upstream's statistics with ``pools`` filled: the whole run's figures per size class (every
        scope merged). Runtime complexity: O(scopes x (pools + streams)) plus the upstream's."""
        s = self.upstream.stats()
        s.pools = {k: v.as_pool() for k, v in self._whole_run().pools.items()}
        return s

    def reset_peak_stats(self) -> None:
        """The upstream's reset, and every scope's peaks started again from their current figures. Runtime
        complexity: O(scopes x (pools + streams))."""
        self.upstream.reset_peak_stats()
        for frame in self._stack:
            for st in (frame.all, *frame.pools.values(), *frame.streams.values()):
                st.peak_bytes, st.peak_count = st.current_bytes, st.current_count

    def reset_accumulated_stats(self) -> None:
        """The upstream's reset, and every scope's totals set back to their current figures. Runtime
        complexity: O(scopes x (pools + streams))."""
        self.upstream.reset_accumulated_stats()
        for frame in self._stack:
            for st in (frame.all, *frame.pools.values(), *frame.streams.values()):
                st.total_bytes, st.total_count = st.current_bytes, st.current_count

    def _check(self) -> None:
        super()._check()
        run = self._whole_run()
        assert run.all.current_bytes == sum(s for s, _ in self._allocs.values()), "counted bytes differ from live ones"
        assert run.all.current_count == len(self._allocs), "counted allocations differ from live ones"
        assert sum(p.current_bytes for p in run.pools.values()) == run.all.current_bytes, "size classes do not add up"
        assert sum(p.current_bytes for p in run.streams.values()) == run.all.current_bytes, "streams do not add up"


# -- snapshot-format logging ----------------------------------------------------------------------
SNAPSHOT_KEYS = ("segments", "device_traces", "allocator_settings", "external_annotations")
"""The keys of ``torch.cuda.memory._snapshot()``'s dict (PyTorch 2.11), all written by :meth:`SnapshotLog.snapshot`."""
SEGMENT_KEYS = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
TRACE_KEYS = ("action", "addr", "size", "stream", "time_us", "frames")
FRAME_KEYS = ("filename", "line", "name")

_OWN_DIRS = tuple(str(Path(__file__).resolve().parent.parent / d) for d in ("pools", "integrations"))


def python_frames(skip_own: bool = True, limit: int = 64) -> list[dict]:
    """The calling thread's Python stack, innermost first, as PyTorch's snapshots write frames
    (``filename``, ``line``, ``name``), without vmstoolkit's own allocator and integration frames.
    Cost: a few microseconds per frame."""
    f = sys._getframe(1)
    out = []
    while f is not None and len(out) < limit:
        code = f.f_code
        if not (skip_own and code.co_filename.startswith(_OWN_DIRS)):
            out.append({"filename": code.co_filename, "line": f.f_lineno, "name": code.co_name})
        f = f.f_back
    return out


class SnapshotLog:
    """Allocation events in PyTorch's memory-snapshot format, per device: what
    ``torch.cuda.memory._snapshot()`` returns (``device_traces`` of ``alloc`` /
    ``free_completed`` / ``oom`` entries with ``addr``, ``size``, ``stream``, ``time_us``,
    ``frames``; ``segments`` of the blocks live when the snapshot is taken, given to
    :meth:`snapshot`), so the loader reads it back, replay replays it and ``torch.cuda._memory_viz``
    draws it. The one writer of the format in vmstoolkit.

    Keeps at most ``max_entries`` events per device: with ``keep="first"`` the first ones (a
    replay needs a run's beginning; later ones are counted in ``dropped``), with ``keep="last"``
    the latest, as ``_record_memory_history(max_entries=)`` keeps its ring. ``stacks="python"``
    writes each event's Python frames (:func:`python_frames`), and keeps those of every live
    allocation for the segments' blocks; ``trace=False`` keeps only those (PyTorch's
    ``enabled="state"``). ``settings`` becomes the snapshot's ``allocator_settings``.
    """

    def __init__(self, max_entries: int = 1_000_000, settings: dict | None = None, *, keep: str = "first",
                 stacks: str | None = None, trace: bool = True) -> None:
        if keep not in ("first", "last"):
            raise ConfigError(f"keep must be 'first' or 'last', got {keep!r}")
        if stacks not in (None, "python"):
            raise ConfigError(f"stacks must be None or 'python', got {stacks!r}")
        if max_entries < 1:
            raise ConfigError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.keep = keep
        self.stacks = stacks
        self.trace = trace
        self.settings = dict(settings or {})
        self.device_traces: dict[int, deque] = {}
        self.live_frames: dict[tuple[int, int], list] = {}  # (device, address) -> frames of its allocation
        self.skip: frozenset[str] = frozenset()  # actions not recorded (``skip_actions``)
        self.dropped = 0

    def record(self, action: str, device: int, addr: int, size: int, stream: int, **more) -> None:
        """Append one entry (``more``: further keys, e.g. ``device_free`` of an ``oom``). Cost: one
        dict, and the frames when ``stacks`` asks for them."""
        frames = python_frames() if self.stacks else []
        if self.stacks:
            if action == "alloc":
                self.live_frames[(device, addr)] = frames
            elif action == "free_completed":
                self.live_frames.pop((device, addr), None)
        if not self.trace or action in self.skip:
            return
        events = self.device_traces.get(device)
        if events is None:
            events = self.device_traces[device] = deque(maxlen=self.max_entries if self.keep == "last" else None)
        if self.keep == "first" and len(events) >= self.max_entries:
            self.dropped += 1
            return
        if self.keep == "last" and len(events) == events.maxlen:
            self.dropped += 1
        events.append({"action": action, "addr": addr, "size": size, "stream": stream,
                       "time_us": int(time.time() * 1e6), "frames": frames, **more})

    def clear(self) -> None:
        """Forget every recorded event and live frame, and the count of dropped events. Runtime complexity:
        O(events)."""
        self.device_traces.clear()
        self.live_frames.clear()
        self.dropped = 0

    def resize(self, max_entries: int) -> None:
        """Keep at most ``max_entries`` events per device from now on (the latest, for ``keep="last"``).
        Runtime complexity: O(1) for ``keep="first"``, O(events) for ``keep="last"`` (the rings are
        copied)."""
        if max_entries < 1:
            raise ConfigError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        if self.keep == "last":
            self.device_traces = {d: deque(ev, maxlen=max_entries) for d, ev in self.device_traces.items()}

    def snapshot(self, live: list[tuple] | None = None, *, include_traces: bool = True,
                 pool: tuple[int, int] | None = None) -> dict:
        """The log as a snapshot dict: ``device_traces`` (devices without events get an empty
        trace; none with ``include_traces=False``) and one segment of one ``active_allocated``
        block per live allocation in ``live`` (``(address, size, device, stream, pool id)``; only
        those of ``pool`` when given). vmstoolkit's allocators have no segments of PyTorch's kind:
        a segment here is the block itself, so the segments add up to the bytes allocated, not
        reserved. Runtime complexity: O(events + L log L) for L live allocations (sorted by device
        and address); every event is copied."""
        segments = []
        for addr, size, device, stream, pool_id in sorted(live or (), key=lambda b: (b[2], b[0])):
            pool_id = tuple(pool_id)
            if pool is not None and pool_id != tuple(pool):
                continue
            frames = self.live_frames.get((device, addr), [])
            segments.append({
                "device": device, "address": addr, "total_size": size, "allocated_size": size, "active_size": size,
                "requested_size": size, "stream": stream, "segment_type": "small" if size <= SMALL_POOL_MAX else "large",
                "segment_pool_id": pool_id, "is_expandable": False, "frames": [],
                "blocks": [{"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                            "frames": frames}]})
        n = max([*self.device_traces, *(s["device"] for s in segments)], default=-1) + 1
        traces = [list(self.device_traces.get(d, ())) if include_traces else [] for d in range(n)]
        return {"segments": segments, "device_traces": traces, "allocator_settings": dict(self.settings),
                "external_annotations": []}

    def dump(self, path: str | Path, live: list[tuple] | None = None) -> Path:
        """Write :meth:`snapshot` to ``path`` as a pickle (gzipped when the name ends in ``.gz``),
        as ``torch.cuda.memory._dump_snapshot`` does; ``vmstoolkit replay PATH`` replays it.
        Runtime complexity: :meth:`snapshot`'s, then the pickle (and gzip) of it and one write."""
        path = Path(path)
        data = pickle.dumps(self.snapshot(live), protocol=4)
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
        return path


class SnapshotLoggingAdaptor(AllocatorAdaptor):
    """Writes every allocation, free and refused request through it to ``log`` (a fresh
    :class:`SnapshotLog` when None) as device ``device``'s events, in PyTorch's snapshot format:
    RMM's ``LoggingResourceAdaptor``, in the format vmstoolkit replays. A free is logged on the
    stream its allocation was made on, as PyTorch logs it. Cost: one dict per event.
    """

    def __init__(self, upstream: Allocator, log: SnapshotLog | None = None, *, device: int = 0) -> None:
        super().__init__(upstream)
        self.log = log if log is not None else SnapshotLog(settings={"vmstoolkit": upstream.name})
        self.device = device
        self._streams: dict[int, int] = {}  # address -> the stream it was allocated on

    def allocate(self, size: int, stream: int = 0) -> int:
        """:meth:`Allocator.allocate`, logged as an ``alloc`` event (an ``oom`` event with the device's
        free bytes when it fails, then the error). Runtime complexity: O(1) plus the upstream's allocate
        (and, with frames recorded, the stack walk)."""
        try:
            addr = self.upstream.allocate(size, stream)
        except OutOfMemoryError:
            free, _ = self.driver.mem_info()
            self.log.record("oom", self.device, free, size, stream, device_free=free)
            raise
        self._streams[addr] = stream
        self.log.record("alloc", self.device, addr, size, stream)
        return addr

    def _freed(self, addr: int, size: int, stream: int | None) -> None:
        own = self._streams.pop(addr, None)
        self.log.record("free_completed", self.device, addr, size, own if own is not None else (stream or 0))

    def live_blocks(self) -> list[tuple]:
        """``(address, size, device, stream, pool id)`` of every live allocation made through this
        adaptor, as :meth:`SnapshotLog.snapshot` takes them. Runtime complexity: O(live)."""
        return [(addr, size, self.device, self._streams[addr], (0, 0))
                for addr, size in self.upstream.live_allocations().items() if addr in self._streams]

    def snapshot(self) -> dict:
        """The log in PyTorch's ``_snapshot()`` format (:meth:`SnapshotLog.snapshot`), with a segment
        per live allocation. Runtime complexity: O(events + L log L) for L live allocations."""
        return self.log.snapshot(self.live_blocks())

    def dump_snapshot(self, path: str | Path) -> Path:
        """Write the log as a ``_dump_snapshot`` pickle at ``path`` (:meth:`SnapshotLog.dump`), with the
        live allocations' segments; returns the path. Runtime complexity: :meth:`snapshot`'s and the write."""
        return self.log.dump(path, self.live_blocks())


__all__ = ["AllocatorAdaptor", "BLOCK_KEYS", "FRAME_KEYS", "LimitingAdaptor", "SEGMENT_KEYS", "SMALL_POOL_MAX",
           "SNAPSHOT_KEYS", "SnapshotLog", "SnapshotLoggingAdaptor", "Statistics", "StatisticsAdaptor", "TRACE_KEYS",
           "past_limit", "unwrap"]
