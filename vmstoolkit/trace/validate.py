"""Checks of a trace's allocs and frees, made once when it is loaded.

- memory live before recording began: frees of addresses the trace never allocated, and the
  segments' ``active_allocated`` blocks at no address the trace touches, become *pre-existing*
  allocations, made when replay starts (PyTorch's ``MemoryViz`` reconstructs the same set);
- a corrupt trace is an error naming the event: a second alloc at a live address, an alloc
  overlapping a live one, a free whose size differs from its alloc, a second free, an alloc of
  (a free without a size is not checked), a negative address or size (in an alloc, a free or a
  segment's block). ``lenient=True`` skips such events instead and counts them by kind.

Cost: two passes over the events, O(n log live) (a sorted list of live starts).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace.events import Action, EventColumns, TraceEvent


@dataclass
class Checked:
    events: tuple
    preexisting: tuple = ()
    skipped: dict = field(default_factory=dict)
    kept: list | None = None
    """Indices of the events kept, when some were skipped."""


def free_action(events) -> Action:
    """``free_completed`` when the trace has any, else ``free_requested`` (older PyTorch)."""
    if isinstance(events, EventColumns):
        completed = bool(events.codes(Action.FREE_COMPLETED).any())
    else:
        completed = any(e.action is Action.FREE_COMPLETED for e in events)
    return Action.FREE_COMPLETED if completed else Action.FREE_REQUESTED


def check_events(events: tuple, live_blocks: list[tuple[int, int, int]], *, where: str, lenient: bool = False) -> Checked:
    """Check ``events`` (see the module docstring); ``live_blocks``: ``(address, size, stream)``
    of the blocks allocated when the snapshot was taken."""
    free = free_action(events)
    alloc = Action.ALLOC
    t0 = events[0].time_us if events else 0
    # pass 1: what was live before the first event
    live: dict[int, int] = {}
    touched: set[int] = set()
    pre: dict[int, TraceEvent] = {}
    sizeless: set[int] = set()
    rows = events.rows if isinstance(events, EventColumns) else lambda: events
    for a, addr, size, stream, _ in rows():  # unpacked: no attribute look-ups (the load's hot loop)
        if (a is alloc or a is free) and (addr < 0 or size < 0):
            continue  # refused in pass 2
        if a is alloc:
            live[addr] = size
            touched.add(addr)
        elif a is free:
            if live.pop(addr, None) is None and addr not in touched:
                if size > 0:
                    pre[addr] = TraceEvent(alloc, addr, size, stream, t0)
                else:  # no size recorded: cannot be made; replay skips its free as before
                    sizeless.add(addr)
            touched.add(addr)
    skipped: dict[str, int] = {}
    for addr, size, stream in live_blocks:
        if addr < 0 or size < 0:
            what = f"block at negative address {addr}" if addr < 0 else f"block of negative size {size} at {addr:#x}"
            if not lenient:
                raise TraceFormatError(f"{where}: the snapshot's segments hold a {what}; the trace is corrupt "
                                       "(lenient=True or --lenient skips such blocks)")
            skipped["negative"] = skipped.get("negative", 0) + 1
            continue
        if addr not in touched and addr not in pre and size > 0:
            pre[addr] = TraceEvent(alloc, addr, size, stream, t0)
    preexisting = tuple(pre[a] for a in sorted(pre))
    # pass 2: the checks, with the pre-existing memory live from the start
    live_at: dict[int, tuple[int, int]] = {e.addr: (e.size, -1) for e in preexisting}
    starts = sorted(live_at)
    freed_at: dict[int, int] = {}
    keep: list | None = None

    def bad(i: int, kind: str, message: str) -> None:
        nonlocal keep
        if not lenient:
            raise TraceFormatError(f"{where}: {message}; the trace is corrupt "
                                   "(lenient=True or --lenient skips such events)")
        skipped[kind] = skipped.get(kind, 0) + 1
        if keep is None:
            keep = list(range(i))

    def origin(j: int) -> str:
        return "before recording" if j < 0 else f"at event {j}"

    for i, (a, addr, size, _, _) in enumerate(rows()):
        if (a is alloc or a is free) and (addr < 0 or size < 0):
            bad(i, "negative", f"event {i} has a negative address {addr}" if addr < 0 else
                f"event {i} has a negative size {size} at {addr:#x}")
            continue
        if a is alloc:
            if addr in live_at:
                bad(i, "double_alloc", f"second alloc at live address {addr:#x} at event {i} (allocated {origin(live_at[addr][1])})")
                continue
            k = bisect.bisect_left(starts, addr)
            if k > 0:
                prev = starts[k - 1]
                psize, pj = live_at[prev]
                if prev + psize > addr:
                    bad(i, "overlap", f"event {i} allocates [{addr:#x}, +{size}) overlapping the live [{prev:#x}, +{psize}) "
                                      f"allocated {origin(pj)}")
                    continue
            if k < len(starts) and starts[k] < addr + size:
                nxt = starts[k]
                nsize, nj = live_at[nxt]
                bad(i, "overlap", f"event {i} allocates [{addr:#x}, +{size}) overlapping the live [{nxt:#x}, +{nsize}) "
                                  f"allocated {origin(nj)}")
                continue
            starts.insert(k, addr)
            live_at[addr] = (size, i)
            freed_at.pop(addr, None)
        elif a is free:
            got = live_at.get(addr)
            if got is None:
                if addr in sizeless and addr not in freed_at:
                    sizeless.discard(addr)  # its one free, skipped by replay
                    if keep is not None:
                        keep.append(i)
                elif addr in freed_at:
                    bad(i, "double_free", f"double free of address {addr:#x} at event {i} "
                                          f"(already freed at event {freed_at[addr]})")
                else:
                    bad(i, "unknown_free", f"event {i} frees {addr:#x}, which is not live")
                continue
            if size and size != got[0]:  # 0: no size recorded
                bad(i, "size_mismatch", f"event {i} frees {size} bytes at {addr:#x}, allocated with {got[0]} bytes "
                                        f"{origin(got[1])}")
                continue
            del live_at[addr]
            starts.pop(bisect.bisect_left(starts, addr))
            freed_at[addr] = i
        if keep is not None:
            keep.append(i)
    if keep is None:
        return Checked(events=events, preexisting=preexisting, skipped=skipped)
    if isinstance(events, EventColumns):
        return Checked(events=events.take(np.array(keep, np.intp)), preexisting=preexisting, skipped=skipped, kept=keep)
    return Checked(events=tuple(events[j] for j in keep), preexisting=preexisting, skipped=skipped, kept=keep)
