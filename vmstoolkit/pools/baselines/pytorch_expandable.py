"""``pytorch-expandable``: a simulation of PyTorch's ``expandable_segments:True``.

Written from the rules of ``ExpandableSegment`` and the expandable paths of
``c10/cuda/CUDACachingAllocator.cpp``:

- instead of one ``cudaMalloc`` per segment, each (stream, pool) grows one huge virtual range
  (1 1/8 of the device memory, :meth:`~vmstoolkit.pools.drivers.base.VMMDriver.reserve`), mapped
  page by page: 20 MiB pages for the large pool, 2 MiB pages for the small pool;
- a request no cached block serves maps just the pages it needs, at the lowest address where
  free and unmapped space together fit it (usually the end of the segment, extending the free
  block there);
- any block may be split (the rest only needs 512 bytes), since pages, not blocks, are what is
  reserved;
- best fit treats a free block at the end of a segment as big as it could grow, so other blocks
  are preferred to it;
- free pages are unmapped and their memory given back only when memory runs out (the retry
  after ``cudaMalloc`` fails) or on ``empty_cache``: a page is unmapped when no live block
  touches it.

Reserved memory is the mapped pages (``segment_map``/``segment_unmap`` in a snapshot).

>>> a = PyTorchExpandableAllocator(make_driver("sim"))
>>> p = a.allocate(30 << 20)           # 30 MiB: two 20 MiB pages mapped
>>> a.stats().reserved_bytes >> 20
40
>>> q = a.allocate(15 << 20)           # 10 MiB left at the end: map one more page
>>> a.stats().reserved_bytes >> 20, q - p == 30 << 20
(60, True)
"""

from __future__ import annotations

from vmstoolkit.errors import DriverOutOfMemoryError
from vmstoolkit.pools.drivers import VMMDriver, make_driver  # noqa: F401  (make_driver: doctest)
from vmstoolkit.pools.baselines.pytorch_caching import (
    Block, BlockPool, PyTorchCachingAllocator, allocation_size, kLargeBuffer, kMinBlockSize, kSmallBuffer,
)
from vmstoolkit.pools.baselines.pytorch_config import PyTorchAllocConfig, as_config
from vmstoolkit.pools.options import PyTorchExpandableOptions
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.drivers.teardown import Graveyard
from vmstoolkit.pools.drivers.txn import Transaction


class ExpandableSegment:
    """One growing virtual range of ``page_size`` pages, each its own physical handle.

    ``map``/``unmap`` work in whole pages; ``handles[i]`` is the handle mapped at page ``i``
    (``None``: not mapped).
    """

    def __init__(self, driver: VMMDriver, stream: int, page_size: int, device_memory: int, graveyard: Graveyard) -> None:
        self.driver = driver
        self.graveyard = graveyard
        self.stream = stream
        self.page = page_size
        # As PyTorch: address space for 1 1/8 of the device memory, so pages unmapped early in
        # the segment can be mapped again at its end.
        self.max_pages = -(-(device_memory + device_memory // 8) // page_size)
        self.size = self.max_pages * page_size
        self.base = driver.reserve(self.size)
        self.handles: list[int | None] = []

    def mapped_bytes(self) -> int:
        """Bytes of the segment's pages that are mapped. Runtime complexity: O(pages)."""
        return self.page * sum(h is not None for h in self.handles)

    def map(self, ptr: int, size: int) -> int:
        """Map the pages covering ``[ptr, ptr+size)`` (``ptr`` on a page); returns the bytes
        mapped, a multiple of the page size, or 0 when the device is out of memory. Runtime
        complexity: O(pages mapped); driver calls: a create and a map per page, one set_access."""
        d, page = self.driver, self.page
        begin = (ptr - self.base) // page
        end = -(-(ptr + size - self.base) // page)
        assert self.base + begin * page == ptr, f"map at {ptr:#x} is not on a page boundary"
        if begin == end:
            return 0
        if self.graveyard.pending:
            # a teardown that failed earlier (an unmap in empty_cache) may still hold these very
            # pages mapped: finish it first, or the map below overlaps its mapping
            self.graveyard.retry()
        while len(self.handles) < end:
            self.handles.append(None)
        try:
            with Transaction(self.graveyard) as tx:
                new = []
                for i in range(begin, end):
                    assert self.handles[i] is None, f"page {i} of segment {self.base:#x} mapped twice"
                    h = d.create(page)
                    tx.undo("release", h, page)
                    new.append(h)
                for i, h in zip(range(begin, end), new):
                    va = self.base + i * page
                    d.map(va, page, h)
                    tx.undo("unmap", va, page)
                d.set_access(ptr, (end - begin) * page)
                tx.commit()
        except DriverOutOfMemoryError:
            self._trim()
            return 0
        for i, h in zip(range(begin, end), new):
            self.handles[i] = h
        return (end - begin) * page

    def unmap(self, ptr: int, size: int) -> tuple[int, int, list]:
        """Forget the pages lying wholly inside ``[ptr, ptr+size)``: returns (start, bytes,
        teardown steps). The caller updates its own state, then runs the steps through its
        graveyard (which synchronizes first, as PyTorch does before unmapping). Runtime
        complexity: O(pages unmapped); no driver call here."""
        page = self.page
        begin = -(-(ptr - self.base) // page)
        end = (ptr + size - self.base) // page
        if begin >= end:
            return ptr, 0, []
        steps = []
        for i in range(begin, end):
            h = self.handles[i]
            self.handles[i] = None
            steps += [("unmap", self.base + i * page, page), ("release", h, page)]
        self._trim()
        return self.base + begin * page, (end - begin) * page, steps

    def _trim(self) -> None:
        while self.handles and self.handles[-1] is None:
            self.handles.pop()

    def close(self) -> list:
        """Forget every page and the virtual range: returns the teardown steps to run. Runtime
        complexity: O(pages)."""
        steps = []
        for i, h in enumerate(self.handles):
            if h is not None:
                steps += [("unmap", self.base + i * self.page, self.page), ("release", h, self.page)]
        self.handles.clear()
        steps.append(("free_address", self.base, self.size))
        return steps


@register_allocator("pytorch-expandable", PyTorchExpandableOptions, "simulation of PyTorch's expandable_segments:True (one growing mapped range per stream and pool)")
class PyTorchExpandableAllocator(PyTorchCachingAllocator):
    """See the module docstring. ``options`` as for ``pytorch-caching``; ``expandable_segments:True``
    is implied (``expandable_segments:False`` is a :class:`~vmstoolkit.errors.ConfigError` of
    :class:`~vmstoolkit.pools.options.PyTorchExpandableOptions`).

    Runtime complexity: as ``pytorch-caching`` (O(log n) per allocation and free in the sorted
    pools), plus the walk past neighbouring blocks that best fit counts as growable, and a
    create and map per page an allocation grows its segment by."""

    name = "pytorch-expandable"
    expandable = True
    options_class = PyTorchExpandableOptions

    def __init__(self, driver: VMMDriver, options: PyTorchExpandableOptions | str | None = None) -> None:
        super().__init__(driver, options)
        self.expandable_segments: list[ExpandableSegment] = []

    def _alloc_conf(self, config: str | None) -> PyTorchAllocConfig:
        if config is None or "expandable_segments" not in config:
            config = f"{config},expandable_segments:True" if config else "expandable_segments:True"
        return as_config(config)

    # -- the rules that differ -------------------------------------------------------------
    def _should_split(self, block: Block, size: int) -> bool:
        return block.size - size >= kMinBlockSize

    def _wanted(self, size: int) -> int:
        return size

    def _adjust_fit(self, pool: BlockPool, stream: int, i: int, key: tuple) -> tuple:
        """Best fit that counts a block at the end of a segment as the size it can grow to:
        walk on to the next larger block while its growable size is smaller (as PyTorch does)."""
        by_ptr, blocks = pool.by_ptr, pool.blocks
        block = by_ptr[key[2]]
        n = len(blocks)
        while block.segment is not None and i + 1 < n:
            nk = blocks[i + 1]
            if nk[0] != stream:
                break
            nb = by_ptr[nk[2]]
            if _growable(nb) < _growable(block):
                i, key, block = i + 1, nk, nb
            else:
                break
        return key

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, retry: bool = False) -> Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.allowed_memory_maximum is not None:
            if self.total_reserved + allocation_size(size) > self.allowed_memory_maximum:
                return None
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped:
            c = self._map_block(c, min(c.size, size), pool)
            if c is None:
                return None
        while c.size < size:  # free -> unmapped -> ...: map some of the next and merge
            nxt = c.next
            c = self._map_block(nxt, min(size - c.size, nxt.size), pool)
            if c is None:
                return None
        pool.remove(c)
        return c

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        # Every block lives in an expandable segment, which this step never frees
        # (PyTorch's release_block refuses them): go straight to unmapping free pages.
        return False

    def _release_cached_blocks(self) -> bool:
        for pool in (self.large_pool, self.small_pool):
            for b in [pool.by_ptr[k[2]] for k in pool.blocks]:
                self._unmap_block(b, pool)
                if b.prev is None and b.next is None:
                    self._release_segment(b, pool)
        return True

    def close(self) -> None:
        """As :meth:`Allocator.close`, then give back the ranges of segments never mapped (their
        one request ran out of memory). Runtime complexity: O(live + cached blocks)."""
        super().close()
        # A segment reserved for a request that then ran out of memory was never mapped, so
        # empty_cache (like PyTorch's) never sees it: give its virtual range back here.
        for pool in (self.large_pool, self.small_pool):
            for b in list(pool.unmapped_by_ptr.values()):
                if b.prev is None and b.next is None:
                    self._release_segment(b, pool)

    # -- expandable segments ---------------------------------------------------------------
    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """The lowest-addressed run of free and unmapped blocks with room for ``size``, or a
        new segment (``find_expandable_block``)."""
        for _, ptr in pool.unmapped.irange((stream, -1), (stream + 1, -1), inclusive=(True, False)):
            c = pool.unmapped_by_ptr[ptr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev  # a free block right before the unmapped space grows into it
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = kSmallBuffer if pool.small else kLargeBuffer
        es = ExpandableSegment(self.driver, stream, page, self.driver.capacity, self.graveyard)
        self.expandable_segments.append(es)
        b = Block(es.base, es.size, stream, pool.small, es)
        b.mapped = False
        pool.insert_unmapped(b)
        return b

    def _map_block(self, to_map: Block, size: int, pool: BlockPool) -> Block | None:
        """Map the pages the first ``size`` bytes of unmapped ``to_map`` need; returns the
        free block they became part of (merged with free neighbours), or ``None`` on OOM."""
        got = to_map.segment.map(to_map.ptr, size)
        if got == 0:
            return None
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if got < to_map.size:
            rest = Block(to_map.ptr + got, to_map.size - got, to_map.stream, to_map.small, to_map.segment)
            rest.mapped = False
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            to_map.size = got
            pool.insert_unmapped(rest)
        self._try_merge(to_map, to_map.prev, pool)
        self._try_merge(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total_reserved += got
        self.num_device_alloc += 1
        return to_map

    def _unmap_block(self, block: Block, pool: BlockPool) -> None:
        """Unmap the whole pages of free ``block``; the partial pages at its ends stay cached."""
        start, nbytes, steps = block.segment.unmap(block.ptr, block.size)
        if nbytes == 0:
            return
        pool.remove(block)
        before = start - block.ptr
        if before > 0:
            bf = Block(block.ptr, before, block.stream, block.small, block.segment)
            bf.prev, bf.next = block.prev, block
            if block.prev is not None:
                block.prev.next = bf
            block.prev = bf
            pool.insert(bf)
        after = block.size - before - nbytes
        if after > 0:
            af = Block(start + nbytes, after, block.stream, block.small, block.segment)
            af.prev, af.next = block, block.next
            if block.next is not None:
                block.next.prev = af
            block.next = af
            pool.insert(af)
        block.ptr, block.size, block.mapped = start, nbytes, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        self.total_reserved -= nbytes
        self.num_device_free += 1
        self.graveyard.run(steps)  # state is consistent first; a failed step waits for a retry

    def _release_segment(self, block: Block, pool: BlockPool) -> None:
        es = block.segment
        assert not block.mapped and block.size == es.size, f"segment {es.base:#x} released while in use"
        pool.remove_unmapped(block)
        self.expandable_segments.remove(es)
        self.graveyard.run(es.close())

    # -- invariants ------------------------------------------------------------------------
    def _check_segments(self) -> None:
        blocks_at: dict[int, Block] = dict(self.active)
        for pool in (self.small_pool, self.large_pool):
            blocks_at.update(pool.by_ptr)
            blocks_at.update(pool.unmapped_by_ptr)
            for s, ptr in pool.unmapped:
                b = pool.unmapped_by_ptr[ptr]
                assert not b.mapped and not b.allocated and b.stream == s, f"{self.name}: unmapped index holds {b}"
        seen = 0
        used = free = mapped_pages = 0
        for es in self.expandable_segments:
            head = blocks_at.get(es.base)
            assert head is not None and head.prev is None, f"{self.name}: segment {es.base:#x} has no head block"
            pos, b, last = es.base, head, None
            while b is not None:
                seen += 1
                assert b.segment is es and b.ptr == pos, f"{self.name}: gap or overlap at {pos:#x} in segment {es.base:#x} ({b})"
                first_page, end_page = (b.ptr - es.base) // es.page, -(-(b.ptr + b.size - es.base) // es.page)
                if b.mapped:
                    for i in range(first_page, end_page):
                        assert i < len(es.handles) and es.handles[i] is not None, f"{self.name}: {b} covers unmapped page {i}"
                    if b.allocated:
                        used += b.size
                    else:
                        free += b.size
                else:
                    assert (b.ptr - es.base) % es.page == 0 and b.size % es.page == 0, f"{self.name}: unmapped {b} not page-aligned"
                    for i in range(first_page, min(end_page, len(es.handles))):
                        assert es.handles[i] is None, f"{self.name}: unmapped {b} covers mapped page {i}"
                if last is not None and not b.allocated and not last.allocated:
                    assert b.mapped != last.mapped, f"{self.name}: free neighbours left unmerged at {b.ptr:#x}"
                last = b
                pos += b.size
                if b.next is not None:
                    assert b.next.prev is b, f"{self.name}: broken links after {b}"
                b = b.next
            assert pos - es.base == es.size, f"{self.name}: blocks of segment {es.base:#x} cover {pos - es.base}, not {es.size}"
            mapped_pages += es.mapped_bytes()
        assert seen == len(blocks_at), f"{self.name}: {len(blocks_at) - seen} blocks belong to no segment"
        assert used + free == mapped_pages == self.total_reserved, \
            f"{self.name}: used {used} + free {free} != mapped {mapped_pages} (reserved {self.total_reserved})"


def _growable(b: Block) -> int:
    """The size ``b`` could grow to: itself plus the unmapped space right after it."""
    nxt = b.next
    return b.size + nxt.size if nxt is not None and not nxt.mapped else b.size
