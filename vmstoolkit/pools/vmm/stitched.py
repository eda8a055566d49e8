"""The stitched pool: cached virtual ranges that map the chunks of several primitive blocks."""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heapify, heappop, heappush

from vmstoolkit.pools.vmm.blocks import PrimitiveBlock, StitchedBlock, StitchedPrefix
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.vmm.primitive import PrimitivePool
from vmstoolkit.pools.drivers.txn import Transaction


class StitchedPool:
    """Stitched blocks over a :class:`PrimitivePool`.

    ``idle`` holds ``(chunks, va, block)`` of every stitched block not allocated now, in best-fit
    order (by chunks, then address: two entries never tie there, so blocks are never compared); a block in it is usable when its ``busy`` count (parts not free, kept by the primitive
    pool's ``take`` and ``give_back`` with one integer update each) is zero. Lookups skip busy
    blocks, at most ``SCAN_LIMIT`` of them. At most ``max_cached`` stitched blocks are kept;
    past that the least recently used unallocated one is unmapped (its range costs no physical
    memory, but every cached block costs page-table entries and bookkeeping on each state
    change of its parts).
    """

    def __init__(self, driver: VMMDriver, primitives: PrimitivePool, max_cached: int) -> None:
        self.driver = driver
        self.g = driver.granularity
        self.primitives = primitives
        self.max_cached = max_cached
        self.blocks: dict[int, StitchedBlock] = {}  # va -> every stitched block
        # sorted, kept with bisect (as PrimitivePool._free); the block in each entry saves the
        # lookups a dict lookup per range they scan
        self.idle: list[tuple[int, int, StitchedBlock]] = []
        self._clock = 0
        # For _collect, the unallocated ranges in the order of a stable sort by last_use: first
        # those never taken (last_use 0; a stitch is taken at once unless a driver failure came
        # in between), in the order they were made (va -> block), then the others, least
        # recently taken first: a heap of (last_use, va), pushed when a range is given back and
        # never updated, whose entry is stale once that range is taken again or destroyed
        # (:meth:`_live`). Only unallocated ranges are on either: the allocated ones, which
        # grow with the live set, are never scanned (Note [LRU of the idle ranges]).
        self._unused: dict[int, StitchedBlock] = {}
        self._lru: list[tuple[int, int]] = []

    # -- bookkeeping by the primitive pool -------------------------------------------------
    # Keeping a sorted set of exactly the usable blocks cost two sorted-list updates per cached
    # stitched block on every state change of a part; counting is an integer update (the
    # primitive pool's take and give_back count ``busy`` themselves), and the lookup skips the
    # few busy blocks instead (replay of llama-ckpt: 1.4x faster).
    SCAN_LIMIT = 64

    # -- stitching ------------------------------------------------------------------------
    def stitch(self, parts: list[PrimitiveBlock]) -> StitchedBlock:
        """Map the chunks of free ``parts`` into one new range; all or nothing.

        Runtime complexity: O(chunks + log S) for ``S`` cached ranges (O(S log S) when past
        ``max_cached`` the least recently used are evicted); driver calls: one reserve, one map
        per chunk, one set_access over the range.
        """
        d, g = self.driver, self.g
        nchunks = sum(p.nchunks for p in parts)
        size = nchunks * g
        with Transaction(self.primitives.graveyard) as tx:
            va = d.reserve(size)
            tx.undo("free_address", va, size)
            d.map_many(va, g, [h for p in parts for h in p.handles], tx)  # a map per chunk, in order
            d.set_access(va, size)
            tx.commit()
        s = StitchedBlock(va, nchunks, list(parts))
        for p in parts:
            p.stitched.add(s)
        self.blocks[va] = s
        self._unused[va] = s
        insort(self.idle, (nchunks, va, s))
        self._collect(keep=s)
        return s

    def destroy(self, s: StitchedBlock, defer: bool = False) -> None:
        """Unmap an unallocated stitched block and free its range (with ``defer``, in the
        graveyard's next batch: the range is forgotten now, its mappings go later).
        Runtime complexity: O(chunks + log S); driver calls: an unmap per chunk, one free_address."""
        assert not s.allocated, f"destroy of allocated {s}"
        g = self.g
        self._unlist(s)
        for p in s.parts:
            p.stitched.discard(s)
        del self.blocks[s.va]
        self._unused.pop(s.va, None)  # its _lru entry, if any, is stale now
        steps = [("unmap", s.va + i * g, g) for i in range(s.nchunks)]
        steps.append(("free_address", s.va, s.nchunks * g))
        if defer:
            self.primitives.graveyard.defer(steps)
        else:
            self.primitives.graveyard.run(steps)

    def _collect(self, keep: StitchedBlock) -> None:
        """Destroy least recently used unallocated blocks (never ``keep``) beyond ``max_cached``.
        Runtime complexity: O(excess log H) for ``H`` heap entries, amortized."""
        excess = len(self.blocks) - self.max_cached
        if excess <= 0:
            self._compact()
            return
        # Note [LRU of the idle ranges]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # The victims are the first ``excess`` unallocated ranges in the order of their last use
        # (sorted(...)[:excess], never taken ones first), as a scan of every cached range in
        # that order would pick them. Such a scan skipped the allocated ranges one by one, and
        # once more ranges are allocated than max_cached (a live set of many stitched tensors),
        # every new stitch scanned all of them: 350 us a stitch on a 2M-event replay. Here only
        # unallocated ranges are visited: _unused holds only those (a range leaves it when
        # first taken), and the heap's stale entries (a range taken again, or destroyed) are
        # dropped as they come up. _check proves the order against the ranges' last_use.
        victims = []
        for s in self._unused.values():
            if len(victims) == excess:
                break
            if s is not keep:
                victims.append(s)
        heap, blocks = self._lru, self.blocks
        while len(victims) < excess and heap:
            last_use, va = heappop(heap)
            s = blocks.get(va)
            if s is not None and not s.allocated and s.last_use == last_use and s is not keep:
                victims.append(s)
        for s in victims:
            self.destroy(s, defer=True)  # on the allocation path: no device sync per eviction

    def _compact(self) -> None:
        """Drop the heap's stale entries once they outnumber the ranges (amortized O(1) a push)."""
        heap = self._lru
        if len(heap) > 2 * len(self.blocks) + 64:
            heap[:] = [e for e in heap if self._live(e)]
            heapify(heap)

    def _live(self, entry: tuple[int, int]) -> bool:
        """Whether a heap entry still stands for an unallocated range with that last use."""
        s = self.blocks.get(entry[1])
        return s is not None and not s.allocated and s.last_use == entry[0]

    def destroy_idle(self, only: set | None = None) -> int:
        """Destroy every unallocated stitched block (or those mapping a block in ``only``); returns
        how many. Runtime complexity: O(S x parts) to choose them, then :meth:`destroy` each."""
        victims = [s for s in self.blocks.values() if not s.allocated
                   and (only is None or any(p in only for p in s.parts))]
        for s in victims:
            self.destroy(s)
        return len(victims)

    # -- use ------------------------------------------------------------------------------
    def best_fit(self, nchunks: int, max_chunks: int) -> StitchedBlock | None:
        """The smallest usable block of ``nchunks`` to ``max_chunks`` chunks, skipping at most
        ``SCAN_LIMIT`` busy ones. Runtime complexity: O(log S + SCAN_LIMIT)."""
        idle = self.idle
        i = bisect_left(idle, (nchunks, -1))
        for k in range(i, min(len(idle), i + self.SCAN_LIMIT + 1)):
            n, _, s = idle[k]
            if n > max_chunks:
                break
            if s.busy == 0:
                return s
        return None

    def best_prefix(self, nchunks: int) -> StitchedBlock | None:
        """The smallest unallocated range of at least ``nchunks`` chunks whose first
        ``nchunks`` chunks are free (its later parts may be in use by others), scanning at most
        ``SCAN_LIMIT`` busy ones. Runtime complexity: O(log n) plus the parts scanned."""
        idle = self.idle
        i = bisect_left(idle, (nchunks, -1))
        for k in range(i, min(len(idle), i + self.SCAN_LIMIT + 1)):
            s = idle[k][2]
            if s.busy == 0:
                return s
            got = 0
            for p in s.parts:
                if p.user is not None:  # not p.free, without the property call
                    break
                got += p.nchunks
                if got >= nchunks:
                    return s
        return None

    def take(self, s: StitchedBlock) -> None:
        """Allocate a usable block: every part becomes used by it. No driver call. Runtime
        complexity: O(log S + parts x log B) for ``B`` free primitive blocks."""
        self._unlist(s)
        self._used_now(s)
        self.primitives.take_many(s.parts, s)

    def take_prefix(self, s: StitchedBlock, nchunks: int) -> StitchedPrefix:
        """Allocate the first ``nchunks`` chunks of an unallocated block, which must be free
        (see :meth:`best_prefix`); no driver call. Runtime complexity: O(log S + parts x log B),
        plus one split of a part."""
        self._unlist(s)
        self._used_now(s)
        taken, need = [], nchunks
        for p in list(s.parts):
            if need == 0:
                break
            if p.nchunks > need:
                p, _ = self.primitives.split(p, need)  # s.parts now holds both halves
            taken.append(p)
            need -= p.nchunks
        prefix = StitchedPrefix(s, nchunks, taken)
        s.prefix = prefix
        self.primitives.take_many(taken, prefix)
        return prefix

    def give_back_prefix(self, prefix: StitchedPrefix) -> None:
        """The prefix's range is whole and unallocated again; its parts are free (and may merge).
        No driver call. Runtime complexity: O(log S + parts x log B)."""
        s = prefix.stitched
        s.allocated = False
        s.prefix = None
        insort(self.idle, (s.nchunks, s.va, s))
        heappush(self._lru, (s.last_use, s.va))
        self.primitives.give_back_many(list(prefix.parts))  # a copy: giving back may merge parts of s.parts

    def give_back(self, s: StitchedBlock) -> None:
        """An allocated range is unallocated again and cached; its parts are free (and may
        merge). No driver call. Runtime complexity: O(log S + parts x log B)."""
        s.allocated = False
        insort(self.idle, (s.nchunks, s.va, s))
        heappush(self._lru, (s.last_use, s.va))
        self.primitives.give_back_many(list(s.parts))  # a copy: giving back may merge neighbouring parts

    def _used_now(self, s: StitchedBlock) -> None:
        """``s`` is allocated now: its last use is now, the last in ``_lru``."""
        s.allocated = True
        self._clock += 1
        s.last_use = self._clock  # its _lru entry, if any, is stale now
        self._unused.pop(s.va, None)

    def _unlist(self, s: StitchedBlock) -> None:
        """Take ``s`` off ``idle``; a block not on it is a broken invariant (``AssertionError``)."""
        idle = self.idle
        i = bisect_left(idle, (s.nchunks, s.va))  # (chunks, va) sorts just before its entry
        if i == len(idle) or idle[i][2] is not s:
            raise AssertionError(f"vms: stitched block {(s.nchunks, s.va)} is not on the idle list")
        del idle[i]

    def _check(self, primitive_blocks: dict) -> None:
        """Assert every range's invariants against ``primitive_blocks`` (va -> live primitive
        block). Runtime complexity: O(S x parts)."""
        g = self.g
        listed = {va: (n, s) for n, va, s in self.idle}
        assert self.idle == sorted(self.idle, key=lambda e: e[:2]), "idle list not sorted"
        for va, s in self.blocks.items():
            assert s.va == va and va % g == 0, f"{s} not granule-aligned"
            assert s.nchunks == sum(p.nchunks for p in s.parts), f"{s} parts do not add up"
            assert s.busy == sum(1 for p in s.parts if not p.free), f"{s} busy count wrong"
            for p in s.parts:
                assert primitive_blocks.get(p.va) is p, f"{s} maps a primitive block that is gone: {p}"
                assert s in p.stitched, f"{p} does not list {s}"
                if s.allocated and s.prefix is None:
                    assert p.user is s, f"allocated {s} has part {p} used by {p.user}"
            if s.prefix is not None:
                pre = s.prefix
                assert s.allocated and pre.parts == s.parts[:len(pre.parts)], f"{pre} is not a prefix of {s}"
                assert sum(p.nchunks for p in pre.parts) == pre.nchunks < s.nchunks
                assert all(p.user is pre for p in pre.parts), f"{pre} has parts used by others"
            assert (listed.get(va) == (s.nchunks, s)) == (not s.allocated), f"{s} idle-set membership wrong"
        assert len(self.idle) == sum(1 for s in self.blocks.values() if not s.allocated)
        idle = {va: s for va, s in self.blocks.items() if not s.allocated}
        live = sorted(e for e in self._lru if self._live(e))
        assert len(set(live)) == len(live), "a range twice on the LRU heap"
        by_heap = [va for _, va in live]
        assert all(self.blocks[va].last_use == 0 for va in self._unused) and set(self._unused) | set(by_heap) == set(idle) \
            and len(self._unused) + len(by_heap) == len(idle), "_unused and _lru do not hold exactly the unallocated ranges"
        assert all(s.last_use > 0 for va, s in idle.items() if va not in self._unused), "a taken range on _unused"
        assert list(self._unused) == [va for va, s in self.blocks.items() if s.last_use == 0], "_unused out of order"
