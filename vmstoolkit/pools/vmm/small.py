"""The small-block pool: requests of 1 MiB or less, packed into one-chunk segments as PyTorch does.

Each segment is one physical chunk (2 MiB) mapped in its own range. Requests are rounded up
to 512 B and served best fit by (size, address) from the free blocks of every segment; a block
is split when at least 512 B would remain, and a freed block merges with its free neighbours.
Wholly free segments are given back by :meth:`SmallPool.release_empty`.
"""

from __future__ import annotations

from sortedcontainers import SortedKeyList

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


def _key(b: _Block) -> tuple[int, int]:
    return (b.size, b.addr)


class SmallPool:
    """See the module docstring. ``allocate`` takes a rounded size; the caller validates."""

    def __init__(self, driver: VMMDriver, graveyard: Graveyard) -> None:
        self.driver = driver
        self.graveyard = graveyard
        self.segment_size = driver.granularity
        self.segments: dict[int, _Segment] = {}
        self.free_blocks = SortedKeyList(key=_key)
        self.used: dict[int, _Block] = {}

    @staticmethod
    def rounded(size: int) -> int:
        """``size`` rounded up to 512 bytes, the size a block of the pool takes. Runtime complexity: O(1)."""
        return round_up(size, MIN_BLOCK)

    def allocate(self, size: int) -> int:
        """Address of a block of ``round_up(size, 512)`` bytes; may create one segment.
        Runtime complexity: O(log s) for ``s`` free blocks; driver calls only for a new segment
        (reserve, create, map, set_access)."""
        need = self.rounded(size)
        i = self.free_blocks.bisect_key_left((need, -1))
        if i < len(self.free_blocks):
            block = self.free_blocks.pop(i)
        else:
            block = self._new_segment()
            self.free_blocks.remove(block)
        rest = block.size - need
        if rest >= MIN_BLOCK:
            tail = _Block(block.addr + need, rest, block.seg)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = need
            self.free_blocks.add(tail)
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
        self.free_blocks.add(block)
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
                self.free_blocks.remove(nb)
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
        self.free_blocks.add(block)

    def release_empty(self) -> int:
        """Give back every segment with no allocated block; returns the bytes released. Runtime
        complexity: O(segments + released x log s); driver calls: an unmap, a release and a
        free_address per segment released."""
        released = 0
        for seg in [s for s in self.segments.values() if s.used == 0]:
            self.free_blocks.remove(_find_whole(self.free_blocks, seg))
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
        for b in list(self.free_blocks) + list(self.used.values()):
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


def _find_whole(free_blocks: SortedKeyList, seg: _Segment) -> _Block:
    """The single free block that spans all of an empty segment."""
    b = free_blocks[free_blocks.bisect_key_left((seg.size, seg.va))]
    assert b.addr == seg.va and b.size == seg.size
    return b
