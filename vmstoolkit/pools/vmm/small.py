"""The small-block pool: requests of 1 MiB or less, packed into one-chunk segments as PyTorch does.

Each segment is one physical chunk (2 MiB) mapped in its own range. Requests are rounded up
to 512 B and served best fit by (size, address) from the free blocks of every segment; a block
is split when at least 512 B would remain, and a freed block merges with its free neighbours.
Wholly free segments are given back by :meth:`SmallPool.release_empty`.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from vmstoolkit.pools.constants import SMALL_SIZE  # noqa: F401 - requests up to this size are small
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.drivers.teardown import Graveyard, unmap_range_steps
from vmstoolkit.pools.drivers.txn import map_new_range
from vmstoolkit.units import round_up

MIN_BLOCK = 512  # rounding and minimum split remainder (PyTorch's kMinBlockSize)


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "seg")

    def __init__(self, addr: int, size: int, seg: "_Segment") -> None:
        self.addr = addr
        self.size = size
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg


class _Segment:
    __slots__ = ("va", "size", "handle", "used")

    def __init__(self, va: int, size: int, handle: int) -> None:
        self.va = va
        self.size = size
        self.handle = handle
        self.used = 0  # bytes of allocated blocks


def _add(free_blocks: list, b: _Block) -> None:
    """Put ``b`` on the free list: ``(size, addr, block)`` entries sorted by size then address
    (an entry's first two fields never tie: two free blocks never share an address, so the
    blocks themselves are never compared). Runtime complexity: O(log s) plus a memmove."""
    insort(free_blocks, (b.size, b.addr, b))


def _remove(free_blocks: list, b: _Block) -> None:
    """Take ``b`` off the free list; a block not on it is a broken invariant (``AssertionError``)."""
    i = bisect_left(free_blocks, (b.size, b.addr))  # (size, addr) sorts just before its entry
    if i == len(free_blocks) or free_blocks[i][2] is not b:
        raise AssertionError(f"small block {b.addr:#x} is not on the free list")
    del free_blocks[i]


class SmallPool:
    """See the module docstring. ``allocate`` takes a rounded size; the caller validates."""

    def __init__(self, driver: VMMDriver, graveyard: Graveyard) -> None:
        self.driver = driver
        self.graveyard = graveyard
        self.segment_size = driver.granularity
        self.segments: dict[int, _Segment] = {}
        # (size, addr, block) of the free blocks, sorted: a plain list kept with bisect, like the
        # primitive pool's free list (a SortedKeyList's add and remove are Python calls over its
        # sublists, with a key function call per entry made; the pool holds tens of free blocks)
        self.free_blocks: list[tuple[int, int, _Block]] = []
        self.used: dict[int, _Block] = {}

    @staticmethod
    def rounded(size: int) -> int:
        """``size`` rounded up to 512 bytes, the size a block of the pool takes. Runtime complexity: O(1)."""
        return round_up(size, MIN_BLOCK)

    def allocate(self, size: int) -> int:
        """Address of a block of ``round_up(size, 512)`` bytes; may create one segment.
        Runtime complexity: O(log s) for ``s`` free blocks (and a memmove of the free list); driver calls only for a new segment
        (reserve, create, map, set_access)."""
        need = self.rounded(size)
        fl = self.free_blocks
        i = bisect_left(fl, (need, -1))
        if i < len(fl):
            block = fl.pop(i)[2]
        else:
            block = self._new_segment()
            _remove(fl, block)
        rest = block.size - need
        if rest >= MIN_BLOCK:
            tail = _Block(block.addr + need, rest, block.seg)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = need
            _add(fl, tail)
        block.free = False
        block.seg.used += block.size
        self.used[block.addr] = block
        return block.addr

    def _new_segment(self) -> _Block:
        size = self.segment_size
        va, h = map_new_range(self.driver, size, self.graveyard)
        seg = _Segment(va, size, h)
        self.segments[va] = seg
        block = _Block(va, size, seg)
        _add(self.free_blocks, block)
        return block

    def owns(self, addr: int) -> bool:
        """A live block of this pool starts at ``addr``. Runtime complexity: O(1)."""
        return addr in self.used

    def free(self, addr: int) -> None:
        """Free the live block at ``addr``, merging it with free neighbours in its segment. No
        driver call: empty segments stay until :meth:`release_empty`. Runtime complexity: O(log s)."""
        block = self.used.pop(addr)
        block.free = True
        block.seg.used -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                _remove(self.free_blocks, nb)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        _add(self.free_blocks, block)

    def release_empty(self) -> int:
        """Give back every segment with no allocated block; returns the bytes released. Runtime
        complexity: O(segments + released x log s); driver calls: an unmap, a release and a
        free_address per segment released."""
        released = 0
        for seg in [s for s in self.segments.values() if s.used == 0]:
            _remove(self.free_blocks, _find_whole(self.free_blocks, seg))
            del self.segments[seg.va]
            released += seg.size
            self.graveyard.run(unmap_range_steps(seg.va, seg.size, seg.handle))
        return released

    @property
    def reserved_bytes(self) -> int:
        """Physical bytes the pool's segments hold. Runtime complexity: O(1)."""
        return len(self.segments) * self.segment_size

    def _check(self) -> set:
        """Assert that blocks tile each segment exactly and no two free blocks touch; returns the
        segments' handles. Runtime complexity: O(blocks + segments)."""
        handles = set()
        free_seen = 0
        heads = {}
        for b in [e[2] for e in self.free_blocks] + list(self.used.values()):
            if b.prev is None:
                heads[b.seg.va] = b
        assert set(heads) == set(self.segments), "a segment has no first block"
        for va, seg in self.segments.items():
            handles.add(seg.handle)
            b, pos, used = heads[va], va, 0
            while b is not None:
                assert b.addr == pos and b.seg is seg, f"small block {b.addr:#x} does not tile segment {va:#x}"
                assert b.size > 0 and b.size % MIN_BLOCK == 0
                if b.free:
                    free_seen += 1
                    assert b.next is None or not b.next.free, f"free blocks at {b.addr:#x} left unmerged"
                else:
                    used += b.size
                    assert self.used.get(b.addr) is b
                pos += b.size
                b = b.next
            assert pos == va + seg.size, f"segment {va:#x} blocks end at {pos:#x}"
            assert used == seg.used, f"segment {va:#x} used bytes {seg.used} != {used}"
        assert free_seen == len(self.free_blocks), "free list and segments disagree"
        return handles


def _find_whole(free_blocks: list, seg: _Segment) -> _Block:
    """The single free block that spans all of an empty segment."""
    b = free_blocks[bisect_left(free_blocks, (seg.size, seg.va))][2]
    assert b.addr == seg.va and b.size == seg.size
    return b
