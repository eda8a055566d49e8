"""``pytorch-caching``: a simulation of PyTorch's CUDA caching allocator.

Faithful to ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) in everything
that decides reserved memory, written from its rules:

- requests are rounded to 512 bytes (:func:`round_size`), or to power-of-two divisions when
  ``roundup_power2_divisions`` is configured;
- rounded sizes up to 1 MiB go to the small pool, larger ones to the large pool; each pool keeps
  its free blocks ordered by (stream, size, address) and serves the first block at least as
  large as the request (best fit, lowest address on ties);
- a request no cached block serves gets a new segment from ``cudaMalloc``
  (:meth:`~vmstoolkit.pools.drivers.base.VMMDriver.mem_alloc`): 2 MiB for small requests, 20 MiB for
  requests under 10 MiB, otherwise the request rounded up to 2 MiB (:func:`allocation_size`);
- a block larger than the request is split when the rest is worth keeping: at least 512 bytes in
  the small pool, more than 1 MiB in the large pool, and never for requests of
  ``max_split_size`` or more (:meth:`PyTorchCachingAllocator._should_split`);
- blocks of ``max_split_size`` or more ("oversize") serve only requests that are themselves
  oversize and no more than ``max_non_split_rounding_size`` (20 MiB) smaller;
- freed blocks merge with free neighbours of the same segment;
- when ``cudaMalloc`` fails: free oversize cached blocks just large enough and retry (only with
  ``max_split_size``), then free every cached unsplit segment and retry, then out of memory.
- ``garbage_collection_threshold`` with ``per_process_memory_fraction``: before allocating a
  new segment, free unsplit large cached blocks older than average until reserved memory is
  under the threshold.

Where segments come from is a parameter (``segments=``, making a :class:`SegmentSource`):
:class:`DriverSegments` (``cudaMalloc``, the default) or :class:`AllocatorSegments` (any
vmstoolkit allocator), which is what ``torch.cuda.MemPool`` with a pluggable allocator does:
PyTorch's caching and splitting on top of a custom allocator's segments.

Streams are kept apart as in PyTorch (a block is only reused on the stream it was allocated
on). Not simulated: CUDA graph private pools, cross-stream ``record_stream`` events (a trace's
``free_completed`` already says when memory came back), IPC.

>>> a = PyTorchCachingAllocator(make_driver("sim"))
>>> p = a.allocate(3 << 20)            # 3 MiB: a 20 MiB segment, split
>>> a.stats().reserved_bytes >> 20
20
>>> q = a.allocate(5 << 20)            # served from the rest of that segment
>>> a.stats().reserved_bytes >> 20, q - p == 3 << 20
(20, True)
"""

from __future__ import annotations

from sortedcontainers import SortedList

from typing import Callable

from vmstoolkit.errors import DriverOutOfMemoryError, OutOfMemoryError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.drivers import VMMDriver, make_driver  # noqa: F401  (make_driver: doctest)
from vmstoolkit.pools.baselines.pytorch_config import UNLIMITED, PyTorchAllocConfig, as_config
from vmstoolkit.pools.constants import SMALL_SIZE
from vmstoolkit.pools.options import PyTorchCachingOptions
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.drivers.teardown import Graveyard

# The constants of CUDACachingAllocator.cpp, with its names.
kMinBlockSize = 512  # every size is rounded to a multiple of 512 bytes
kSmallSize = SMALL_SIZE  # the largest "small" request: 1 MiB (pools/constants.py)
kSmallBuffer = 2 << 20  # small requests are packed in 2 MiB segments
kMinLargeAlloc = 10 << 20  # requests between 1 and 10 MiB get a 20 MiB segment...
kLargeBuffer = 20 << 20  # ...of this size
kRoundLarge = 2 << 20  # larger requests get a segment rounded up to 2 MiB


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``size`` rounded up to the next of ``divisions`` equal steps between two powers of two.
    Runtime complexity: O(1).

    >>> roundup_power2_next_division(1200, 4)   # steps 1024, 1280, 1536, 1792
    1280
    """
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, config: PyTorchAllocConfig | None = None) -> int:
    """The block size PyTorch gives a request of ``size`` bytes. Runtime complexity: O(1).

    >>> round_size(1), round_size(513), round_size(1 << 20)
    (512, 1024, 1048576)
    """
    if size < kMinBlockSize:
        return kMinBlockSize
    if config is not None:
        divisions = config.divisions_for(size)
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
    return -(-size // kMinBlockSize) * kMinBlockSize


def allocation_size(size: int) -> int:
    """The segment ``cudaMalloc``-ed for a rounded request no cached block can serve.
    Runtime complexity: O(1).

    >>> [allocation_size(s) >> 20 for s in (4096, 3 << 20, 10 << 20, (21 << 20) + 1)]
    [2, 20, 10, 22]
    """
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return -(-size // kRoundLarge) * kRoundLarge


class Block:
    """A range of a segment: allocated, cached (free), or (expandable only) not mapped.

    ``prev``/``next`` link the blocks of one segment in address order; ``gc_base`` is the
    pool's free-block lookup count when the block was cached (its "age" for garbage collection).
    """

    __slots__ = ("ptr", "size", "stream", "small", "allocated", "mapped", "prev", "next", "segment", "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, small: bool, segment=None) -> None:
        self.ptr = ptr
        self.size = size
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment  # the ExpandableSegment (expandable mode), else None
        self.gc_base = 0

    def is_split(self) -> bool:
        """The block is part of a segment split in several blocks. Runtime complexity: O(1)."""
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        """``(stream, size, ptr)``: the block's place in its pool's order. Runtime complexity: O(1)."""
        return (self.stream, self.size, self.ptr)

    def __repr__(self) -> str:
        state = "alloc" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"<Block {self.ptr:#x}+{self.size} {state} s{self.stream}>"


class BlockPool:
    """The cached blocks of one pool (small or large), ordered as ``BlockComparatorSize``.

    ``blocks`` is a sorted list of ``(stream, size, ptr)`` keys; ``by_ptr`` finds the block of a
    key. Lookup, insertion and removal cost O(log n).
    """

    __slots__ = ("small", "blocks", "by_ptr", "lookups", "unmapped", "unmapped_by_ptr")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks: SortedList = SortedList()
        self.by_ptr: dict[int, Block] = {}
        self.lookups = 0  # get_free_blocks_call_count: the clock of garbage collection
        self.unmapped: SortedList = SortedList()  # (stream, ptr) of unmapped blocks (expandable segments)
        self.unmapped_by_ptr: dict[int, Block] = {}

    def insert(self, b: Block) -> None:
        """Cache the free block ``b``. Runtime complexity: O(log n)."""
        b.gc_base = self.lookups
        self.blocks.add((b.stream, b.size, b.ptr))
        self.by_ptr[b.ptr] = b

    def remove(self, b: Block) -> None:
        """Take the cached block ``b`` out. Runtime complexity: O(log n)."""
        self.blocks.remove((b.stream, b.size, b.ptr))
        del self.by_ptr[b.ptr]

    def insert_unmapped(self, b: Block) -> None:
        """Keep the unmapped block ``b`` (an expandable segment's hole). Runtime complexity: O(log n)."""
        self.unmapped.add((b.stream, b.ptr))
        self.unmapped_by_ptr[b.ptr] = b

    def remove_unmapped(self, b: Block) -> None:
        """Take the unmapped block ``b`` out. Runtime complexity: O(log n)."""
        self.unmapped.remove((b.stream, b.ptr))
        del self.unmapped_by_ptr[b.ptr]

    def __len__(self) -> int:
        return len(self.blocks)


class SegmentSource:
    """Where :class:`PyTorchCachingAllocator` gets its segments: the protocol.

    ``driver`` is the driver the segments' memory is counted on (the caching allocator's own);
    ``keeps_cached``: True for a private pool in use (a live ``torch.cuda.MemPool``): the last
    retry of a failed segment request frees no cached segment (PyTorch skips that retry while a
    pool is being allocated to, and its ``release_cached_blocks`` passes over pools still in use),
    nor does garbage collection (``garbage_collection_threshold`` walks the default pool only), so
    that only the oversize-block retry (``max_split_size``) gives cached memory back before out of
    memory. ``empty_cache`` and ``close`` give every whole cached segment back either way: for a
    private pool that is PyTorch's ``empty_cache()`` once the pool object is gone (while it lives,
    PyTorch keeps its segments).
    """

    driver: VMMDriver
    keeps_cached: bool = False

    def allocate(self, nbytes: int) -> int | None:
        """A new segment of ``nbytes``; None when memory is short (the caching allocator then
        frees cached blocks and asks again, or raises out of memory). Cost: the source's; one
        driver call (``cudaMalloc``) or one upstream allocate in the two sources here."""
        raise NotImplementedError

    def free(self, ptr: int, nbytes: int) -> None:
        """Give back the whole segment of ``nbytes`` at ``ptr``. Cost: the source's; one driver call
        (``cudaFree``) or one upstream free in the two sources here."""
        raise NotImplementedError

    def check(self, caching: "PyTorchCachingAllocator") -> None:
        """Assert that what the source holds agrees with ``caching``'s segments (its ``_check``).
        Cost: the source's, at least O(segments); no driver call."""
        raise NotImplementedError

    def empty_cache(self) -> None:
        """Give back what the source caches itself (after the caching allocator's ``empty_cache``).
        Cost: O(1) here (nothing cached); a source's own otherwise."""

    def close(self) -> None:
        """After the caching allocator's ``close``: give everything back. Cost: O(1) here; a source's
        own otherwise."""


class DriverSegments(SegmentSource):
    """Segments from ``cudaMalloc`` (:meth:`VMMDriver.mem_alloc`), as PyTorch's default device
    allocator; a ``cudaFree`` that fails waits in ``graveyard`` for a retry. Cost: one driver call
    per segment made or given back."""

    def __init__(self, driver: VMMDriver, graveyard: Graveyard) -> None:
        self.driver, self.graveyard = driver, graveyard

    def allocate(self, nbytes: int) -> int | None:
        """``cudaMalloc(nbytes)``; None when the driver is out of memory. Cost: O(1); one driver call."""
        try:
            return self.driver.mem_alloc(nbytes)
        except DriverOutOfMemoryError:
            return None

    def free(self, ptr: int, nbytes: int) -> None:
        """``cudaFree``, through the graveyard (the caching allocator's state is consistent
        first; a failed call waits for a retry). Cost: O(1); one driver call (no synchronize: nothing
        is unmapped)."""
        self.graveyard.run([("mem_free", ptr, nbytes)])

    def check(self, caching: "PyTorchCachingAllocator") -> None:
        """The segments (and the graveyard's) are all the physical memory the driver counts. Cost:
        O(held teardown steps) plus reading ``caching.total_reserved``; no driver call."""
        held = caching.total_reserved + self.graveyard.held_bytes()
        assert held == self.driver.physical_bytes, \
            f"{caching.name}: holds {held} bytes (graveyard included), the driver counts {self.driver.physical_bytes}"


class AllocatorSegments(SegmentSource):
    """Segments from any vmstoolkit allocator ``upstream`` (``torch.cuda.MemPool`` over a
    pluggable allocator): each segment is one ``upstream.allocate(nbytes)``, given back with
    ``upstream.free``; ``upstream`` is closed with the caching allocator. ``keeps_cached`` as
    PyTorch does for a private pool in use (:class:`SegmentSource`). Cost: one upstream call per
    segment made or given back."""

    def __init__(self, upstream, keeps_cached: bool = True) -> None:
        self.upstream, self.driver, self.keeps_cached = upstream, upstream.driver, keeps_cached

    def allocate(self, nbytes: int) -> int | None:
        """``upstream.allocate(nbytes)``; None when it is out of memory. Cost: the upstream's allocate
        plus O(1)."""
        try:
            return self.upstream.allocate(nbytes)
        except OutOfMemoryError:
            return None

    def free(self, ptr: int, nbytes: int) -> None:
        """``upstream.free(ptr)``. Cost: the upstream's free plus O(1)."""
        self.upstream.free(ptr)

    def check(self, caching: "PyTorchCachingAllocator") -> None:
        """``upstream``'s invariants, on ``caching``'s driver, and every segment one of its live
        allocations, of its size. Cost: the upstream's ``_check`` and ``live_allocations`` plus
        O(segments)."""
        assert self.driver is caching.driver, f"{caching.name}: segments from an allocator on another driver"
        self.upstream._check()
        live = self.upstream.live_allocations()
        for ptr, nbytes in caching.segments.items():
            assert live.get(ptr) == nbytes, f"{caching.name}: segment {ptr:#x} of {nbytes} bytes is not live upstream"

    def empty_cache(self) -> None:
        """``upstream.empty_cache()``. Cost: the upstream's plus O(1)."""
        self.upstream.empty_cache()

    def close(self) -> None:
        """``upstream.close()``. Cost: the upstream's plus O(1)."""
        self.upstream.close()


@register_allocator("pytorch-caching", PyTorchCachingOptions, "simulation of PyTorch's CUDA caching allocator (cudaMalloc segments, best fit, splitting)")
class PyTorchCachingAllocator(Allocator):
    """See the module docstring. ``options``: the checked
    :class:`~vmstoolkit.pools.options.PyTorchCachingOptions` (as
    :func:`~vmstoolkit.pools.make_allocator` passes them), or its ``config`` alone, a
    ``PYTORCH_CUDA_ALLOC_CONF``-style string (checked by the options class). ``segments``: where
    segments come from, ``driver -> SegmentSource`` called once with ``driver``
    (:class:`DriverSegments`, ``cudaMalloc``, by default), e.g.
    ``segments=lambda d: AllocatorSegments(make_allocator("vms", d))``.

    Runtime complexity, for ``n`` cached blocks of the request's pool (small or large): an
    allocation is O(log n) (best fit in a sorted list, a split) plus one ``cudaMalloc`` when no
    block fits; garbage collection (``garbage_collection_threshold``) and the retry after a
    failed ``cudaMalloc`` walk the cached blocks, O(n) and their frees. A free is O(log n)
    (merging with free neighbours of its segment)."""

    streams_apart = True  # a pool per stream, as in PyTorch
    recorded_settings_option = "config"  # a snapshot's recorded allocator settings apply (trace/settings.py)
    options_class = PyTorchCachingOptions

    name = "pytorch-caching"
    expandable = False

    def __init__(self, driver: VMMDriver, options: PyTorchCachingOptions | str | None = None, *,
                 segments: Callable[[VMMDriver], SegmentSource] | None = None) -> None:
        super().__init__(driver)
        if not isinstance(options, PyTorchCachingOptions):
            options = self.options_class(config=options)
        self.graveyard = Graveyard(driver)
        # made here on the allocator's own driver, so that reserved memory is counted on one
        self.segment_source = segments(driver) if segments is not None else DriverSegments(driver, self.graveyard)
        self.config = self._alloc_conf(options.config)
        self.small_pool = BlockPool(small=True)
        self.large_pool = BlockPool(small=False)
        self.active: dict[int, Block] = {}  # ptr -> allocated block
        self.segments: dict[int, int] = {}  # cudaMalloc-ed segments: ptr -> size
        self.total_reserved = 0  # total_allocated_memory: what this allocator holds
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        frac = self.config.per_process_memory_fraction
        self.allowed_memory_maximum = int(frac * driver.capacity) if frac is not None else None
        self._max_split = self.config.max_split_size
        self._max_round = self.config.max_non_split_rounding_size
        self._plain_rounding = not any(self.config.roundup_power2_divisions)

    # -- sizes and pools -------------------------------------------------------------------

    def _alloc_conf(self, config: str | None) -> PyTorchAllocConfig:
        """The parsed ``config`` (checked already by the options class)."""
        return as_config(config)
    def round_size(self, size: int) -> int:
        """:func:`round_size` under this allocator's settings. Runtime complexity: O(1)."""
        if self._plain_rounding:  # the common case, inlined: 2x faster replays than calling round_size()
            return -(-size // kMinBlockSize) * kMinBlockSize if size >= kMinBlockSize else kMinBlockSize
        return round_size(size, self.config)

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= kMinBlockSize
        return size < self._max_split and remaining > kSmallSize

    # -- the protocol ----------------------------------------------------------------------
    def _allocate(self, orig_size: int, stream: int) -> int:
        size = self.round_size(orig_size)
        pool = self.small_pool if size <= kSmallSize else self.large_pool
        block = self._get_free_block(pool, stream, size)
        if block is None:
            if self.allowed_memory_maximum is not None and self.config.garbage_collection_threshold > 0.0:
                self._garbage_collect()
            block = (self._alloc_block(pool, stream, size)
                     or (self._release_available_cached_blocks(pool, stream, size) and self._alloc_block(pool, stream, size))
                     or (self._release_for_retry() and self._alloc_block(pool, stream, size, retry=True)))
            if not block:
                d = self.driver
                free, total = d.mem_info()
                raise OutOfMemoryError(
                    f"{self.name}: CUDA out of memory. Tried to allocate {self._wanted(size)} bytes "
                    f"(request {orig_size}); {self.total_reserved} reserved, {self.allocated_bytes} allocated, "
                    f"{free} of {total} free on the device",
                    requested=orig_size, reserved=self.total_reserved, capacity=total)
        if self._should_split(block, size):
            rest = Block(block.ptr + size, block.size - size, stream, block.small, block.segment)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        self.active[block.ptr] = block
        return block.ptr

    def _free(self, addr: int) -> None:
        block = self.active.pop(addr)
        block.allocated = False
        self._free_block(block)

    def _empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give back every cached segment nothing uses."""
        self.graveyard.retry()
        self._release_cached_blocks()
        self.segment_source.empty_cache()

    def close(self) -> None:
        """As :meth:`Allocator.close`, then the segment source's ``close``. Runtime complexity:
        O(live + cached blocks), each segment given back with one driver (or upstream) call."""
        try:
            super().close()
        finally:
            self.segment_source.close()

    # -- the steps of malloc ---------------------------------------------------------------
    def _wanted(self, size: int) -> int:
        return allocation_size(size)

    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """Best fit: the first cached block by (stream, size, address) that can serve ``size``."""
        if self.config.garbage_collection_threshold > 0.0 and self.allowed_memory_maximum is not None:
            pool.lookups += 1
        blocks = pool.blocks
        i = blocks.bisect_left((stream, size, -1))
        if i == len(blocks):
            return None
        key = blocks[i]
        if key[0] != stream:
            return None
        key = self._adjust_fit(pool, stream, i, key)
        bsize = key[1]
        if size < self._max_split and bsize >= self._max_split:
            return None  # never split an oversize block for a smaller request
        if size >= self._max_split and bsize >= size + self._max_round:
            return None  # an oversize block may serve only a little less than its size
        block = pool.by_ptr.pop(key[2])
        blocks.remove(key)
        return block

    def _adjust_fit(self, pool: BlockPool, stream: int, i: int, key: tuple) -> tuple:
        """Hook for expandable segments' "size it can grow to" best fit; here: the first fit."""
        return key

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, retry: bool = False) -> Block | None:
        """A new segment for a request of rounded ``size``, or ``None`` when memory is short."""
        if retry:
            self.num_alloc_retries += 1
        nbytes = allocation_size(size)
        if self.allowed_memory_maximum is not None and self.total_reserved + nbytes > self.allowed_memory_maximum:
            return None
        ptr = self.segment_source.allocate(nbytes)
        if ptr is None:
            return None
        self.total_reserved += nbytes
        self.num_device_alloc += 1
        self.segments[ptr] = nbytes
        return Block(ptr, nbytes, stream, pool.small)

    def _free_block(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with free neighbours."""
        pool = self.small_pool if block.small else self.large_pool
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)

    def _try_merge(self, dst: Block, src: Block | None, pool: BlockPool) -> None:
        """Absorb neighbour ``src`` into ``dst`` when it is free and mapped alike (``try_merge_blocks``)."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if src is dst.prev:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_block(self, block: Block, pool: BlockPool) -> None:
        """``cudaFree`` a whole cached segment."""
        pool.remove(block)
        del self.segments[block.ptr]
        self.total_reserved -= block.size
        self.num_device_free += 1
        self.segment_source.free(block.ptr, block.size)  # state first, then the source

    def _release_for_retry(self) -> bool:
        """The last retry's release (:meth:`_release_cached_blocks`), unless the segment source
        keeps cached blocks then (:attr:`SegmentSource.keeps_cached`)."""
        return True if self.segment_source.keeps_cached else self._release_cached_blocks()

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """Free oversize cached blocks, just enough for ``size``: the first retry."""
        if self._max_split == UNLIMITED:
            return False
        target = max(size, self._max_split)
        blocks = pool.blocks
        i = blocks.bisect_left((stream, target, -1))
        if i < len(blocks) and blocks[i][0] == stream:
            self._release_block(pool.by_ptr[blocks[i][2]], pool)
            return True
        # No single block is large enough: free oversize blocks, largest first.
        released = 0
        i -= 1
        while released < target and i >= 0:
            s, bsize, ptr = blocks[i]
            if s != stream or bsize < self._max_split:
                break
            released += bsize
            self._release_block(pool.by_ptr[ptr], pool)
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> bool:
        """Free every cached block that is a whole segment: the last retry, and ``empty_cache``."""
        for pool in (self.large_pool, self.small_pool):
            for _, _, ptr in list(pool.blocks):
                b = pool.by_ptr[ptr]
                if b.prev is None and b.next is None:
                    self._release_block(b, pool)
        return True

    def _garbage_collect(self) -> None:
        """Free unsplit large cached blocks older than average until under the threshold. Not in
        a private pool (:attr:`SegmentSource.keeps_cached`): PyTorch's collection walks only the
        default large pool."""
        if self.segment_source.keeps_cached:
            return
        threshold = int(self.config.garbage_collection_threshold * self.allowed_memory_maximum)
        if self.total_reserved <= threshold:
            return
        target = self.total_reserved - threshold
        pool = self.large_pool
        freeable = [pool.by_ptr[k[2]] for k in pool.blocks if not pool.by_ptr[k[2]].is_split() and pool.by_ptr[k[2]].segment is None]
        if not freeable:
            return
        total_age = sum(pool.lookups - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for b in list(freeable):
                age = pool.lookups - b.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    freeable.remove(b)
                    self._release_block(b, pool)

    # -- invariants ------------------------------------------------------------------------
    def _segment_heads(self):
        """(head block, segment size) of every segment."""
        heads = {}
        for b in self.active.values():
            while b.prev is not None:
                b = b.prev
            heads[b.ptr] = b
        for pool in (self.small_pool, self.large_pool):
            for b in pool.by_ptr.values():
                while b.prev is not None:
                    b = b.prev
                heads[b.ptr] = b
        return heads

    def _check(self) -> None:
        """Assert the live blocks, both pools and every segment's chain of blocks. Runtime
        complexity: O(blocks)."""
        super()._check()
        core = self._held_by_core()
        assert set(self.active) == set(core), f"{self.name}: allocated blocks differ from live allocations"
        for ptr, b in self.active.items():
            assert b.allocated and b.ptr == ptr, f"{self.name}: active block {b} is not allocated at {ptr:#x}"
            assert b.size >= self.round_size(core[ptr]), f"{self.name}: block {b} smaller than its request {core[ptr]}"
        for pool in (self.small_pool, self.large_pool):
            assert len(pool.blocks) == len(pool.by_ptr), f"{self.name}: pool index out of step"
            for s, size, ptr in pool.blocks:
                b = pool.by_ptr[ptr]
                assert not b.allocated and b.mapped and b.size == size and b.stream == s and b.small == pool.small, \
                    f"{self.name}: cached block {b} does not match its key ({s}, {size}, {ptr:#x})"
        self._check_segments()

    def _check_segments(self) -> None:
        heads = self._segment_heads()
        assert set(heads) == set(self.segments), f"{self.name}: segments {len(self.segments)} vs block chains {len(heads)}"
        used = free = 0
        for ptr, head in heads.items():
            pos, b, last_free = ptr, head, False
            while b is not None:
                assert b.ptr == pos, f"{self.name}: gap or overlap at {pos:#x} in segment {ptr:#x} ({b})"
                assert b.small == head.small and b.stream == head.stream, f"{self.name}: block {b} in a foreign segment"
                if b.allocated:
                    assert self.active.get(b.ptr) is b, f"{self.name}: allocated block {b} not active"
                    used += b.size
                else:
                    pool = self.small_pool if b.small else self.large_pool
                    assert pool.by_ptr.get(b.ptr) is b, f"{self.name}: free block {b} not cached"
                    assert not last_free, f"{self.name}: free neighbours left unmerged at {b.ptr:#x}"
                    free += b.size
                last_free = not b.allocated
                pos += b.size
                if b.next is not None:
                    assert b.next.prev is b, f"{self.name}: broken links after {b}"
                b = b.next
            assert pos - ptr == self.segments[ptr], f"{self.name}: blocks of segment {ptr:#x} cover {pos - ptr}, not {self.segments[ptr]}"
        assert used + free == self.total_reserved == sum(self.segments.values()), \
            f"{self.name}: used {used} + free {free} != reserved {self.total_reserved}"
        self.segment_source.check(self)
