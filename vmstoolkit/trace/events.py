"""Typed trace events, made right after loading so nothing downstream reads raw dicts."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np


class Action(str, Enum):
    """The ``action`` of a PyTorch memory-history entry."""

    ALLOC = "alloc"
    FREE_REQUESTED = "free_requested"
    FREE_COMPLETED = "free_completed"
    SEGMENT_ALLOC = "segment_alloc"
    SEGMENT_FREE = "segment_free"
    SEGMENT_MAP = "segment_map"
    SEGMENT_UNMAP = "segment_unmap"
    SNAPSHOT = "snapshot"
    OOM = "oom"
    OTHER = "other"  # anything newer PyTorch versions add


class TraceEvent(NamedTuple):
    action: Action
    addr: int
    size: int
    stream: int
    time_us: int


_new_event = functools.partial(tuple.__new__, TraceEvent)  # TraceEvent(*row) without the argument parsing
EVENT_BATCH = 1 << 16
"""Events made at a time when :class:`EventColumns` is iterated: each is dropped once the
caller has moved on, so iterating 2M events holds 64k of them (about 6 MB), not 2M (200 MB)."""


class EventColumns(Sequence):
    """A trace's events as integer columns; each :class:`TraceEvent` is made when it is read.

    What the loader hands to :class:`Trace`: five numpy columns (``action`` codes index
    ``actions``), 33 bytes per event, against about 180 for a tuple of ``TraceEvent``s. It is a
    read-only sequence equal to the tuple of the same events, so code that iterates, indexes
    or compares ``trace.events`` sees no difference; the replay reads the columns directly
    (:func:`vmstoolkit.trace.replay.event_arrays`). Runtime complexity: O(1) per event read."""

    __slots__ = ("action", "addr", "size", "stream", "time_us", "actions")

    def __init__(self, action, addr, size, stream, time_us, actions) -> None:
        self.action, self.addr, self.size, self.stream, self.time_us = action, addr, size, stream, time_us
        self.actions = tuple(actions)

    def __len__(self) -> int:
        return len(self.action)

    def _make(self, lo: int, hi: int) -> list:
        acts = np.array(self.actions, dtype=object)[self.action[lo:hi].astype(np.intp)].tolist()
        return list(map(_new_event, zip(acts, self.addr[lo:hi].tolist(), self.size[lo:hi].tolist(),
                                        self.stream[lo:hi].tolist(), self.time_us[lo:hi].tolist())))

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step == 1:
                return tuple(self._make(lo, max(lo, hi)))
            return tuple(self[j] for j in range(lo, hi, step))
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"event {i} of {n}")
        return self._make(j, j + 1)[0]

    def __iter__(self):
        for lo in range(0, len(self), EVENT_BATCH):
            yield from self._make(lo, lo + EVENT_BATCH)

    def rows(self):
        """The events as plain ``(action, addr, size, stream, time_us)`` tuples, a batch at a
        time: what a loop that unpacks them reads, without making ``TraceEvent``s (half the cost)."""
        acts = np.array(self.actions, dtype=object)
        for lo in range(0, len(self), EVENT_BATCH):
            hi = lo + EVENT_BATCH
            yield from zip(acts[self.action[lo:hi].astype(np.intp)].tolist(), self.addr[lo:hi].tolist(),
                           self.size[lo:hi].tolist(), self.stream[lo:hi].tolist(), self.time_us[lo:hi].tolist())

    def take(self, rows: np.ndarray) -> EventColumns:
        """The events at ``rows`` (indices, in order), as columns."""
        return EventColumns(self.action[rows], self.addr[rows], self.size[rows], self.stream[rows],
                            self.time_us[rows], self.actions)

    def codes(self, *actions: Action) -> np.ndarray:
        """Whether each event's action is one of ``actions`` (bool column)."""
        want = [k for k, a in enumerate(self.actions) if a in actions]
        return np.isin(self.action, np.array(want, self.action.dtype))

    def __eq__(self, other) -> bool:
        if isinstance(other, EventColumns):
            return len(self) == len(other) and all(
                np.array_equal(getattr(self, c), getattr(other, c)) for c in ("addr", "size", "stream", "time_us")) \
                and tuple(self.actions[k] for k in self.action.tolist()) == \
                tuple(other.actions[k] for k in other.action.tolist())
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"<EventColumns of {len(self)} events>"


@dataclass(frozen=True)
class Trace:
    """One device's allocation history from a snapshot.

    ``events`` keep every action (segment events too, for checking allocator simulations);
    replay uses ``alloc`` and ``free_completed``.
    """

    name: str
    events: tuple[TraceEvent, ...] | EventColumns
    """A tuple, or from a file :class:`EventColumns` (the same sequence, made as it is read)."""
    device: int = 0
    source: str = ""
    allocator_settings: dict = field(default_factory=dict, compare=False, hash=False)
    preexisting: tuple[TraceEvent, ...] = ()
    """Allocations live before recording began (``alloc`` events, address order), which replay
    makes first: see :mod:`vmstoolkit.trace.validate`."""
    skipped: dict = field(default_factory=dict, compare=False, hash=False)
    """Corrupt events a lenient load left out, by kind (``double_alloc``, ``overlap``, ...)."""
    frames: tuple | None = field(default=None, compare=False, hash=False, repr=False)
    """With ``frames=True`` at load: each event's ``(filename, line, name)`` frames."""

    def __len__(self) -> int:
        return len(self.events)

    @property
    def preexisting_bytes(self) -> int:
        return sum(e.size for e in self.preexisting)

    @property
    def expandable_segments(self) -> bool:
        return bool(self.allocator_settings.get("expandable_segments", False))

    def alloc_free_events(self) -> list[TraceEvent] | EventColumns:
        """The events replay acts on: allocs and completed frees, or requested frees when the
        snapshot has no completed ones (older PyTorch)."""
        ev = self.events
        if isinstance(ev, EventColumns):  # columns stay columns: a 2M-event trace is never a list
            free = Action.FREE_COMPLETED if ev.codes(Action.FREE_COMPLETED).any() else Action.FREE_REQUESTED
            return ev.take(np.flatnonzero(ev.codes(Action.ALLOC, free)))
        has_completed = any(e.action is Action.FREE_COMPLETED for e in ev)
        free = Action.FREE_COMPLETED if has_completed else Action.FREE_REQUESTED
        return [e for e in ev if e.action is Action.ALLOC or e.action is free]

    def recorded_peak_reserved(self) -> int:
        """Peak of the bytes the recorded allocator reserved, from its segment events."""
        cur = peak = 0
        for e in self.events:
            if e.action in (Action.SEGMENT_ALLOC, Action.SEGMENT_MAP):
                cur += e.size
                peak = max(peak, cur)
            elif e.action in (Action.SEGMENT_FREE, Action.SEGMENT_UNMAP):
                cur -= e.size
        return peak
