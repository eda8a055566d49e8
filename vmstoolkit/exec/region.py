"""Placement inside one GPU region at compile time: an allocator of offsets that prefers the
oldest hole, in O(log n) per operation.

Note [Oldest fit in logarithmic time]
-------------------------------------
Rationale. The compiler places every buffer in the hole freed earliest among those large enough
(:class:`OffsetAllocator` says why). Scanning every hole large enough made each allocation cost
the number of holes, which grows with the region: from 12 holes scanned per allocation at 4
LLaMA-7B-wide training blocks to 146 at 64 (half the working set), and compile time per vertex
tripled from 1 to 64 blocks.

Approach. The choice is the least ``(freed at, size, offset)`` among holes of at least the
requested size. Holes are grouped by the time they were freed, which is a compile-time position
(``-1`` for the initial range, else a vertex count, so a small non-negative integer); a segment
tree over those times keeps, per node, the largest hole freed in its span. The oldest time with a
hole large enough is found by one descent (go left whenever the left child's largest hole is
large enough), and within that time's group, kept sorted by (size, offset), the smallest fit by
bisection.

Implementation. ``_OldestFit``: the tree is a flat list (node ``i`` has children ``2i`` and
``2i + 1``, leaf of time ``t`` at ``cap + t + 1``); after the groups change (an allocation's
split, or a free's merge, is one update), the maxima above each time touched are recomputed up
to the first unchanged one. The leaves double when a later time arrives (O(cap), amortized). Groups are
plain sorted lists: most times free one or two holes.

Cost: O(log T + g) per operation, T the latest time seen, g the holes of one group. The choice is
exactly the scan's, pinned by ``tests/exec/test_compiler_golden.py``; the figures are in
``benchmarks/compile_time.py``.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from sortedcontainers import SortedDict


class _OldestFit:
    """Free ranges ``(freed at, size, offset)``; :meth:`find` returns the least one of at least a
    given size (module Note). Times are integers of at least -1."""

    _FIRST_CAP = 1024  # leaves at first: the times of a small graph's compile fit without growing

    def __init__(self) -> None:
        self._cap = self._FIRST_CAP
        self._max = [0] * (2 * self._cap)  # largest size in each node's span of times
        self._groups: dict[int, list[tuple[int, int]]] = {}  # freed at -> sorted (size, offset)

    def __iter__(self):
        """Every free range as ``(t, size, offset)``, in no particular order."""
        for t, g in self._groups.items():
            for size, off in g:
                yield t, size, off

    def add(self, t: int, size: int, off: int) -> None:
        """Insert a free range freed at ``t``. O(log T + g)."""
        self.update((), (t, size, off))

    def remove(self, t: int, size: int, off: int) -> None:
        """Delete a free range that :meth:`add` inserted. O(log T + g)."""
        self.update(((t, size, off),))

    def update(self, removed, added: tuple[int, int, int] | None = None) -> None:
        """Delete the ``removed`` ranges ``(t, size, offset)`` and insert ``added``, then bring the
        tree up to date once per time touched (an allocation's split or a free's merge is one
        call, not one per range). O((log T + g) per range)."""
        groups = self._groups
        touched = []
        for t, size, off in removed:
            g = groups[t]
            del g[bisect_left(g, (size, off))]
            if not g:
                del groups[t]
            touched.append(t)
        if added is not None:
            t, size, off = added
            if t + 1 >= self._cap:
                self._grow(t + 1)
            insort(groups.setdefault(t, []), (size, off))
            touched.append(t)
        for t in touched:
            self._fix(t)

    def _fix(self, t: int) -> None:
        """Set the leaf of ``t`` to its group's largest range and recompute the maxima above it
        until one is unchanged (above that, nothing changed)."""
        g = self._groups.get(t)
        top = g[-1][0] if g else 0
        m = self._max
        i = self._cap + t + 1
        if m[i] == top:
            return
        m[i] = top
        i >>= 1
        while i:
            a, b = m[2 * i], m[2 * i + 1]
            new = a if a > b else b
            if m[i] == new:
                break
            m[i] = new
            i >>= 1

    def find(self, size: int) -> tuple[int, int, int] | None:
        """The least ``(t, size, offset)`` among ranges of at least ``size`` bytes, or None.
        O(log T + log g)."""
        size = max(size, 1)  # every range holds at least one byte; 0 would descend to empty leaves
        m = self._max
        if m[1] < size:
            return None
        i, cap = 1, self._cap
        while i < cap:  # to the left child when its span holds a range large enough
            i <<= 1
            if m[i] < size:
                i += 1
        t = i - cap - 1
        g = self._groups[t]
        sz, off = g[bisect_left(g, (size, -1))]
        return t, sz, off

    def _grow(self, leaf: int) -> None:
        cap = self._cap
        while cap <= leaf:
            cap *= 2
        m = [0] * (2 * cap)
        for t, g in self._groups.items():
            m[cap + t + 1] = g[-1][0]
        for i in range(cap - 1, 0, -1):
            m[i] = max(m[2 * i], m[2 * i + 1])
        self._cap, self._max = cap, m

    def _check(self) -> None:
        for t, g in self._groups.items():
            assert g and g == sorted(g), f"group {t} empty or unsorted"
        cap, m = self._cap, self._max
        for i in range(cap, 2 * cap):
            g = self._groups.get(i - cap - 1)
            assert m[i] == (g[-1][0] if g else 0), f"leaf of time {i - cap - 1}"
        for i in range(1, cap):
            assert m[i] == max(m[2 * i], m[2 * i + 1]), f"node {i}"


class OffsetAllocator:
    """Allocator of offsets inside one region ``[0, size)`` that prefers the *oldest* hole.

    Every free range remembers when it was freed (a compile-time position; coalesced ranges keep
    the latest). ``allocate`` takes, among the ranges large enough, the one freed earliest (ties:
    the smallest, then the lowest), from its low end. For the runtime this is what matters: a new
    buffer must wait for the last accesses of what occupied its bytes, so the oldest hole lets a
    reload start earliest (prefetch). Best fit instead put reloads in the hole just freed by the
    previous block, and the event-driven executor on the sim backend lost 40% of its compute
    utilisation at half budget (0.47 s against a 0.31 s bound on the 16-block LLaMA).

    Free ranges are kept by time freed for the search (module Note) and by offset for coalescing.
    Runtime complexity: O(log(n) + log(T)) per allocate and per free (n: free ranges, T: the
    latest time given to :meth:`free`).
    """

    def __init__(self, size: int):
        self.size = size
        self._fit = _OldestFit()
        self._by_off = SortedDict()  # off -> (size, freed at)
        if size > 0:
            self._by_off[0] = (size, -1)
            self._fit.add(-1, size, 0)
        self._used: dict[int, int] = {}
        self.used = 0
        self.peak = 0

    def allocate(self, size: int) -> int | None:
        """Offset of ``size`` new bytes, or None when no free range is large enough."""
        found = self._fit.find(size)
        if found is None:
            return None
        t, sz, off = found
        del self._by_off[off]
        if sz > size:
            self._fit.update(((t, sz, off),), (t, sz - size, off + size))
            self._by_off[off + size] = (sz - size, t)
        else:
            self._fit.update(((t, sz, off),))
        self._used[off] = size
        self.used += size
        self.peak = max(self.peak, self.used)
        return off

    def allocate_at(self, off: int, size: int) -> None:
        """Take the ``size`` bytes at ``off``, which must lie inside one free range (a compaction
        choosing its destinations itself); the range's remainders keep its time. O(log n + log T)."""
        i = self._by_off.bisect_right(off) - 1
        start, (sz, t) = self._by_off.peekitem(i)
        if not (start <= off and off + size <= start + sz):
            raise AssertionError(f"[{off}, {off + size}) is not free")
        del self._by_off[start]
        left, right = off - start, start + sz - (off + size)
        self._fit.update(((t, sz, start),), (t, left, start) if left else None)
        if left:
            self._by_off[start] = (left, t)
        if right:
            self._fit.add(t, right, off + size)
            self._by_off[off + size] = (right, t)
        self._used[off] = size
        self.used += size
        self.peak = max(self.peak, self.used)

    def holes(self):
        """The free ranges as ``(offset, size)``, lowest first."""
        return [(o, s) for o, (s, _) in self._by_off.items()]

    def free(self, off: int, when: int = 0) -> None:
        """Give back the range allocated at ``off``, freed at time ``when`` (an integer of at
        least -1, usually the number of vertices emitted so far); it merges with free neighbours
        and the merged range takes the latest of their times."""
        size = self._used.pop(off)
        self.used -= size
        start, end = off, off + size
        merged = []
        i = self._by_off.bisect_left(off)
        if i < len(self._by_off):  # right neighbour
            roff, (rsz, rt) = self._by_off.peekitem(i)
            if roff == end:
                del self._by_off[roff]
                merged.append((rt, rsz, roff))
                end += rsz
                when = max(when, rt)
        if i > 0:  # left neighbour
            loff, (lsz, lt) = self._by_off.peekitem(i - 1)
            if loff + lsz == start:
                del self._by_off[loff]
                merged.append((lt, lsz, loff))
                start = loff
                when = max(when, lt)
        self._by_off[start] = (end - start, when)
        self._fit.update(merged, (when, end - start, start))

    def _check(self) -> None:
        spans = sorted([(o, s) for o, (s, _) in self._by_off.items()] + list(self._used.items()))
        pos = 0
        for o, s in spans:
            assert o == pos, f"gap or overlap at {pos} / {o}"
            pos = o + s
        assert pos == self.size
        assert sum(self._used.values()) == self.used
        self._fit._check()
        assert sorted((t, s, o) for o, (s, t) in self._by_off.items()) == \
            sorted(self._fit)
        for o, (s, _) in self._by_off.items():  # coalesced: no two free ranges touch
            assert o + s not in self._by_off
