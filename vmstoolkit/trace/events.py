"""Typed trace events, made right after loading so nothing downstream reads raw dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


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


@dataclass(frozen=True)
class Trace:
    """One device's allocation history from a snapshot.

    ``events`` keep every action (segment events too, for checking allocator simulations);
    replay uses ``alloc`` and ``free_completed``.
    """

    name: str
    events: tuple[TraceEvent, ...]
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

    def alloc_free_events(self) -> list[TraceEvent]:
        """The events replay acts on: allocs and completed frees, or requested frees when the
        snapshot has no completed ones (older PyTorch)."""
        has_completed = any(e.action is Action.FREE_COMPLETED for e in self.events)
        free = Action.FREE_COMPLETED if has_completed else Action.FREE_REQUESTED
        return [e for e in self.events if e.action is Action.ALLOC or e.action is free]

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
