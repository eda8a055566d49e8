"""The primitive pool: blocks that own physical chunks mapped in their own virtual ranges."""

from __future__ import annotations

from bisect import bisect_left, insort
from vmstoolkit.pools.vmm.blocks import VA_BITS, VA_MASK, PrimitiveBlock, Reservation, free_key
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.drivers.teardown import Graveyard
from vmstoolkit.pools.drivers.txn import Transaction


class PrimitivePool:
    """Primitive blocks, their free list (best fit by (chunks, address)) and their chunks.

    When a block changes state, each cached stitched range that maps it counts one more (or one
    fewer) busy part (``StitchedBlock.busy``), so the stitched pool knows which ranges are usable.

    With ``coalesce``, a block given back merges with a free neighbour in the same reservation
    (no driver call: the chunks are already mapped side by side), as PyTorch merges the free
    blocks of a segment. Without it, splits only ever cut blocks smaller, and requests that a
    merged block would have served need a stitch. A merge that would cut a cached stitched
    range's part in two is skipped: both blocks must be mapped, one right after the other, by
    the same stitched ranges (or by none).
    """

    def __init__(self, driver: VMMDriver, graveyard: Graveyard, coalesce: bool = False) -> None:
        self.driver = driver
        self.graveyard = graveyard
        self.g = driver.granularity
        self.blocks: dict[int, PrimitiveBlock] = {}  # va -> block (every live primitive block)
        self._by_end: dict[int, PrimitiveBlock] = {}  # end va -> block (left neighbours)
        self.coalesce = coalesce
        self.merges = 0
        # the key of every free block ((chunks, va) as one int, PrimitiveBlock.key), sorted: a
        # plain list kept with bisect, not a SortedList, whose add and remove are two Python
        # calls each over its sublists (a tenth of vms's replay time): the pool holds tens to
        # hundreds of free blocks, a memmove of a few KB at most; :attr:`free_list` reads it
        self._free: list[int] = []
        self.free_chunks = 0
        self.total_chunks = 0

    # -- creation and release -------------------------------------------------------------
    def create(self, nchunks: int) -> PrimitiveBlock:
        """A new free block of ``nchunks`` fresh chunks: create, reserve, map, set access.

        All or nothing: a driver failure on any step undoes the earlier ones and re-raises.
        Runtime complexity: O(nchunks + log B) for ``B`` free blocks; driver calls: ``nchunks``
        creates and maps, one reserve and one set_access.
        """
        d, g = self.driver, self.g
        size = nchunks * g
        with Transaction(self.graveyard) as tx:
            va = d.reserve(size)
            tx.undo("free_address", va, size)
            handles = d.create_mapped(va, g, nchunks, tx)  # create, map per chunk: one call
            d.set_access(va, size)
            tx.commit()
        block = PrimitiveBlock(va, handles, Reservation(va, size))
        self.blocks[va] = block
        self._by_end[va + size] = block
        insort(self._free, block.key)
        self.free_chunks += nchunks
        self.total_chunks += nchunks
        return block

    @property
    def free_list(self) -> list[tuple[int, int]]:
        """``(chunks, va)`` of every free block, smallest first, then by address (a new list).
        Runtime complexity: O(B)."""
        return [(k >> VA_BITS, k & VA_MASK) for k in self._free]

    def release(self, block: PrimitiveBlock) -> None:
        """Unmap and release a free block's chunks; free its range with the last block in it.

        The caller has destroyed every stitched block that maps it. Runtime complexity:
        O(nchunks + log B); driver calls: an unmap and a release per chunk (and the range's free).
        """
        assert block.free and not block.stitched, f"release of {block} still in use or stitched"
        self.graveyard.flush()  # evicted ranges may still map its chunks: unmap them first
        g = self.g
        remove_key(self._free, block.key)
        del self.blocks[block.va]
        del self._by_end[block.va + block.nchunks * g]
        self.free_chunks -= block.nchunks
        self.total_chunks -= block.nchunks
        steps = []
        for i, h in enumerate(block.handles):
            steps += [("unmap", block.va + i * g, g), ("release", h, g)]
        block.res.refs -= 1
        if block.res.refs == 0:
            steps.append(("free_address", block.res.va, block.res.size))
        self.graveyard.run(steps)

    # -- state ----------------------------------------------------------------------------
    # take and give_back run on nearly every event of a replay: they count the busy parts of the
    # cached stitched ranges themselves (one integer per range, as the stitched pool's callbacks
    # did: a call per state change was a twentieth of a vms replay) and touch the free list once.
    def take(self, block: PrimitiveBlock, user: object) -> None:
        """Mark a free block used by ``user`` (itself or a stitched block). Runtime complexity:
        O(log B), plus the stitched ranges that map it (each counts one more busy part)."""
        remove_key(self._free, block.key)
        self.free_chunks -= block.nchunks
        block.user = user
        for s in block.stitched:  # the stitched pool counts busy parts of its ranges only
            s.busy += 1

    def take_many(self, parts: list[PrimitiveBlock], user: object) -> None:
        """:meth:`take` of each of ``parts`` (a stitched range's), in order. Runtime complexity:
        O(parts x log B), plus the stitched ranges that map them."""
        fl = self._free
        for block in parts:
            key = block.key
            i = bisect_left(fl, key)
            if i == len(fl) or fl[i] != key:
                remove_key(fl, key)  # raises: the block is not free
            del fl[i]
            self.free_chunks -= block.nchunks
            block.user = user
            for s in block.stitched:
                s.busy += 1

    def give_back(self, block: PrimitiveBlock) -> None:
        """Mark a used block free again; with ``coalesce``, merge it with free neighbours of its
        range (:meth:`_mergeable`, :meth:`_join`). No driver call. Runtime complexity: O(log B),
        plus the stitched ranges that map it and its neighbours."""
        self.give_back_many((block,))

    def give_back_many(self, parts) -> None:
        """:meth:`give_back` of each of ``parts`` in order (a stitched range's, in one call: not
        a Python call per part). ``parts`` must not be a list that merging changes (pass a copy
        of a stitched range's parts). Runtime complexity: O(parts x log B), plus the stitched
        ranges that map them and their neighbours."""
        fl, blocks, by_end, g, coalesce = self._free, self.blocks, self._by_end, self.g, self.coalesce
        for block in parts:
            block.user = None
            n = block.nchunks
            self.free_chunks += n
            for s in block.stitched:
                s.busy -= 1
            if coalesce:
                # the cheap refusals first, here (most frees have no free neighbour in the range);
                # the merged block goes on the free list once, at the end
                right = blocks.get(block.va + n * g)
                if right is not None and right.user is None and right.res is block.res:
                    at = self._mergeable(block, right)
                    if at is not None:
                        remove_key(fl, right.key)
                        block = self._join(block, right, at)
                left = by_end.get(block.va)
                if left is not None and left.user is None and left.res is block.res:
                    at = self._mergeable(left, block)
                    if at is not None:
                        remove_key(fl, left.key)
                        block = self._join(left, block, at)
            insort(fl, block.key)

    @staticmethod
    def _mergeable(a: PrimitiveBlock, b: PrimitiveBlock) -> dict | None:
        """Whether free ``a`` and the free block ``b`` right after it in the same range may merge
        (see the class): ``{stitched range: where it maps a}`` (then b, right after), or None.
        Runtime complexity: O(parts of the stitched ranges that map them)."""
        at = {}
        if a.stitched or b.stitched:
            if a.stitched != b.stitched:
                return None
            for s in a.stitched:
                i = s.parts.index(a)
                if i + 1 >= len(s.parts) or s.parts[i + 1] is not b:
                    return None
                at[s] = i
        return at

    def _join(self, a: PrimitiveBlock, b: PrimitiveBlock, at: dict) -> PrimitiveBlock:
        """Merge ``a`` and ``b`` (:meth:`_mergeable` said ``at``), neither on the free list, into
        ``a``, which takes ``b``'s chunks (one object fewer per merge than a new block; ``b`` is
        gone), not on the free list either. The same updates, in the same order, as making a
        new block would do (``blocks`` gets ``a`` back at its end). Runtime complexity:
        O(chunks + parts of ``at``)."""
        blocks, g = self.blocks, self.g
        del blocks[a.va]
        del blocks[b.va]
        del self._by_end[a.va + a.nchunks * g]
        a.handles = a.handles + b.handles
        a.nchunks = n = len(a.handles)
        a.key = n << VA_BITS | a.va
        a.res.refs -= 1
        blocks[a.va] = a
        self._by_end[a.va + n * g] = a
        for s, i in at.items():  # a.stitched already lists them (it equals b.stitched)
            s.parts[i:i + 2] = [a]
        self.merges += 1
        return a

    def split(self, block: PrimitiveBlock, nchunks: int) -> tuple[PrimitiveBlock, PrimitiveBlock]:
        """Split a free block into its first ``nchunks`` chunks and the rest (both free).

        No driver call: each chunk is already mapped on its own. The head is ``block`` itself,
        cut to its first ``nchunks`` chunks; stitched blocks that map it now refer to both halves.
        Runtime complexity: O(nchunks + log B), plus the stitched ranges that map it.
        """
        head, tail = self._cut(block, nchunks)
        insort(self._free, head.key)
        insort(self._free, tail.key)
        return head, tail

    def split_take(self, block: PrimitiveBlock, nchunks: int) -> PrimitiveBlock:
        """:meth:`split`, then :meth:`take` of the head for itself, which never goes on the free
        list meanwhile. Runtime complexity: that of :meth:`split`."""
        head, tail = self._cut(block, nchunks)
        insort(self._free, tail.key)
        self.free_chunks -= nchunks
        head.user = head
        for s in head.stitched:
            s.busy += 1
        return head

    def _cut(self, block: PrimitiveBlock, nchunks: int) -> tuple[PrimitiveBlock, PrimitiveBlock]:
        """:meth:`split` but for putting the halves on the free list: ``block`` itself becomes the
        head (its first ``nchunks`` chunks; one object fewer per split than two new blocks), a
        new block the tail. The same updates, in the same order, as two new blocks would make."""
        assert block.user is None and 0 < nchunks < block.nchunks
        remove_key(self._free, block.key)
        g = self.g
        handles = block.handles
        tail = PrimitiveBlock(block.va + nchunks * g, handles[nchunks:], block.res)
        block.handles = handles[:nchunks]
        block.nchunks = nchunks
        block.key = nchunks << VA_BITS | block.va
        self.blocks[tail.va] = tail
        self._by_end[tail.va] = block
        self._by_end[tail.va + tail.nchunks * g] = tail
        st = block.stitched
        if st:
            for s in st:
                i = s.parts.index(block)
                s.parts.insert(i + 1, tail)
            tail.stitched = set(st)
        return block, tail

    # -- search ---------------------------------------------------------------------------
    def best_fit(self, nchunks: int) -> PrimitiveBlock | None:
        """The smallest free block of at least ``nchunks`` chunks, lowest address first.

        Runtime complexity: O(log n).
        """
        fl = self._free
        i = bisect_left(fl, nchunks << VA_BITS)  # free_key(nchunks, 0): before every block of nchunks
        return self.blocks[fl[i] & VA_MASK] if i < len(fl) else None

    def free_blocks(self, largest_first: bool = False) -> list[PrimitiveBlock]:
        """The free blocks, smallest (or largest) first (a list: safe to change the pool).
        Runtime complexity: O(B)."""
        return list(self.iter_free(largest_first))

    def iter_free(self, largest_first: bool = False):
        """Lazily, the free blocks smallest (or largest) first; the pool must not change meanwhile.
        Runtime complexity: O(1) to start, O(1) per block taken."""
        keys = reversed(self._free) if largest_first else iter(self._free)
        blocks = self.blocks
        return (blocks[k & VA_MASK] for k in keys)

    def _check(self) -> set:
        """Assert the pool's invariants; returns the set of handles it owns. Runtime complexity:
        O(blocks + chunks)."""
        g = self.g
        owned = set()
        free = 0
        by_res: dict[int, list[PrimitiveBlock]] = {}
        listed = set(self._free)
        assert self._free == sorted(listed), "free list not sorted, or a block listed twice"
        for va, b in self.blocks.items():
            assert b.va == va and va % g == 0, f"{b} not granule-aligned"
            assert b.res.va <= va and va + b.nchunks * g <= b.res.va + b.res.size, f"{b} outside its reservation"
            for h in b.handles:
                assert h not in owned, f"chunk {h} owned by two primitive blocks"
                owned.add(h)
            by_res.setdefault(b.res.va, []).append(b)
            if b.free:
                free += b.nchunks
                assert b.key == free_key(b.nchunks, b.va) and b.key in listed, f"free {b} missing from the free list"
            for s in b.stitched:
                assert b in s.parts, f"{b} lists {s} that does not map it"
        for blocks in by_res.values():
            blocks.sort(key=lambda b: b.va)
            assert blocks[0].res.refs == len(blocks), f"reservation {blocks[0].res.va:#x} counts {blocks[0].res.refs} blocks, has {len(blocks)}"
            for a, b in zip(blocks, blocks[1:]):
                assert a.va + a.nchunks * g <= b.va, f"{a} overlaps {b}"
        assert len(self._free) == sum(1 for b in self.blocks.values() if b.free), "free list holds used blocks"
        assert self._by_end == {b.va + b.nchunks * g: b for b in self.blocks.values()}, "end index out of date"
        assert free == self.free_chunks, f"free chunks {self.free_chunks} != {free}"
        assert len(owned) == self.total_chunks, f"total chunks {self.total_chunks} != {len(owned)}"
        return owned


def remove_key(free_list: list, key: tuple[int, int] | int) -> None:
    """Take ``key`` off the sorted list ``free_list`` (a pool's free or idle blocks); a missing
    key is a broken invariant, raised as an ``AssertionError`` (the base class checks every free
    before a pool sees it, so no caller's input reaches this). Runtime complexity:
    O(log B) plus a memmove of the entries after it."""
    i = bisect_left(free_list, key)
    if i == len(free_list) or free_list[i] != key:
        shown = key if isinstance(key, tuple) else (key >> VA_BITS, key & VA_MASK)  # (chunks, va)
        raise AssertionError(f"vms: free block {shown} is not on the free list")
    del free_list[i]
