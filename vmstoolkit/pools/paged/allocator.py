"""``paged``: a best-fit heap over one large virtual range, physical memory mapped page by page.

Two heaps (:mod:`~vmstoolkit.pools.paged.heap`) over ranges reserved once: requests of 1 MiB or
less in 512 B units, larger ones in whole 2 MiB pages (or, with ``large_unit``, in finer units
that let neighbouring large blocks share a page: 0.1 GiB less on the traces' peaks, but a shared
page cannot be reclaimed while either block lives; on the H200's training run 512 KiB units
remapped more and reserved more than whole pages, so whole pages stay the default:
``docs/results.md#paged-policy``, ``#train-h200`` run 12). A block's address never changes and a
freed block merges with its neighbours, as in a classic heap. Large blocks go first to free
pages that still have chunks (``placement="mapped"``, the default: when the best fit would need
new chunks, the lowest free window whose pages all have theirs, if any; ``"best-fit"`` ignores
mappings). On the H200 training run's own allocation sequence this leaves the driver almost no
work after each round's first, largest step, at the same peak (``docs/results.md#train-h200``,
run 14). What makes the heap cheap in physical memory is that a page gets a physical chunk only when a live block first needs it, and
keeps it while free (a repeated pattern calls the driver no more) until chunks are short:

- chunks come first from the free stack (pages reclaimed earlier);
- then new chunks (``cuMemCreate``) while the total stays within the most pages that live
  blocks have ever needed at once (plus ``slack_pages``): physical memory never exceeds that peak;
- then the chunks of pages no live block uses, taken back (``cuMemUnmap``, after a
  ``cuCtxSynchronize``: queued work may still use a block PyTorch has freed), highest first,
  at least ``reclaim_batch`` per synchronize; or, with ``aliases=True``, mapped once more where
  they are needed and left mapped where they were (no unmap, so no synchronize; a page whose
  chunk is then live through its other mapping is the only one remapped, after a synchronize);
- only then new chunks beyond the peak (it is a new peak).

New chunks are one ``cuMemCreate`` of one page each: a CUDA driver maps a physical allocation
only whole, so a chunk that a page may lose alone must be a handle of its own
(``docs/architecture.md``, Note [whole handles]).

Capacity limits, and what happens at them: a request larger than the large range (twice the
device by default) is an out-of-memory error before any work; the small range (``small_va_bytes``,
4 GiB) full sends small requests to pages of the large one; block records (``max_blocks`` to start)
double whenever they run out (the PyTorch hook republishes the new arrays), so a program with
millions of live small blocks keeps them 512 B apart; more than 62 streams share the last stream
bit, which waits for the whole device.

Peak reserved is therefore the peak number of pages live blocks touch: the largest blocks
round up to 2 MiB, small ones share pages. The decisions are compiled Numba code shared with
the PyTorch hook (:mod:`vmstoolkit.integrations.native_torch`); this class runs them from
Python and does the driver work, for replays and as the hook's slow path.

This module is the allocator protocol; the slow path the compiled paths call (placing and
freeing blocks, stream ordering, the driver work) is :mod:`~vmstoolkit.pools.paged.slow_path`.
"""

from __future__ import annotations

import threading

import numpy as np

from vmstoolkit.errors import AllocatorClosedError, InvalidFreeError
from vmstoolkit.pools.base import Allocator, CompiledReplay, ReplayArrays
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.options import PagedOptions
from vmstoolkit.pools.paged.slow_path import PagedSlowPath
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.drivers.teardown import Graveyard

from vmstoolkit.pools.paged.heap import (  # noqa: F401 - the allocator's constants, defined beside the heap
    G_NSLOTS, MAX_SLOTS, MIN_BLOCKS, OVERFLOW_BIT, SMALL_SIZE, SMALL_UNIT_SHIFT,
)


@register_allocator("paged", PagedOptions, "best-fit heap over one virtual range; 2 MiB pages mapped on demand, reclaimed at the peak")
class PagedAllocator(PagedSlowPath, Allocator):
    name = "paged"
    streams_apart = True  # streams are ordered through tagged chunks, below
    compiled_hook = "vmstoolkit.integrations.native_torch:NativeHook"

    def __init__(self, driver: VMMDriver, options: PagedOptions | None = None, **keywords) -> None:
        """``paged`` over ``driver`` with the checked ``options`` (as :func:`~vmstoolkit.pools.make_allocator`
        passes them). Called directly, ``keywords`` are the options (``max_blocks=16``): they are
        checked by :class:`~vmstoolkit.pools.options.PagedOptions`, against the driver too, as
        ``make_allocator`` checks them. Runtime complexity: O(pages + units + max_blocks) to
        build the heaps' arrays."""
        super().__init__(driver)
        if options is None:
            options = PagedOptions(**keywords)
            options.check_for_driver(driver.capacity, driver.granularity)
        elif keywords:
            raise TypeError(f"PagedAllocator takes its options as one PagedOptions or as keywords, not both: {keywords}")
        self.options = options
        page = driver.granularity
        va_bytes = options.va_bytes or 2 * -(-driver.capacity // page) * page
        small_va_bytes, large_unit = options.small_va_bytes, options.large_unit or page
        self.reclaim_batch = options.reclaim_batch
        max_blocks, aliases = options.max_blocks, options.aliases
        self.page = page
        self.page_shift = page.bit_length() - 1
        large_shift = large_unit.bit_length() - 1
        max_chunks = va_bytes // page + small_va_bytes // page
        self.aliases = aliases
        self.chunk_live = np.zeros(max_chunks, np.int32)  # per chunk id: live pages mapping it (0 or 1)
        self.chunk_tag = np.zeros(max_chunks, np.int64)  # per chunk id: streams (slot bits) that may still use it
        self.nmaps = np.zeros(max_chunks, np.int32)  # per chunk id: pages mapping it (more than one: aliases)
        self._lend_hand = np.zeros(1, np.int64)
        self.large = H.Heap(va_bytes >> large_shift, large_shift, self.page_shift, buckets=4096, max_blocks=max_blocks,
                            chunk_live=self.chunk_live, chunk_tag=self.chunk_tag)
        self.small = H.Heap(small_va_bytes >> SMALL_UNIT_SHIFT, SMALL_UNIT_SHIFT, self.page_shift,
                            buckets=(SMALL_SIZE >> SMALL_UNIT_SHIFT) + 1, max_blocks=max_blocks,
                            chunk_live=self.chunk_live, chunk_tag=self.chunk_tag)
        for h in (self.large, self.small):
            h.meta[H.M_CLOCK_ORDER] = options.reclaim == "clock"
        self.large.meta[H.M_PLACE_MAPPED] = options.placement == "mapped"
        self.g = np.zeros(16, np.int64)  # heap.G_* slots, then the PyTorch hook's counters
        self.g[H.G_SLACK] = options.slack_pages
        self.stream_slots = np.zeros(MAX_SLOTS, np.int64)  # slot -> stream handle (g[G_NSLOTS] in use)
        self._slot: dict[int, int] = {}
        self.on_arrays_changed = None  # called after heap arrays are replaced (the hook republishes)
        self._stuck: list = []  # (heap, page) left mapped by a rollback whose unmap failed
        self.graveyard = Graveyard(driver)  # driver teardown that failed, for a retry
        self.chunk_stack = np.zeros(max_chunks, np.int32)
        self.handles: list = []  # chunk id -> driver handle (None once released)
        self._spare_ids: list[int] = []
        self._out_pages = np.zeros(max_chunks, np.int64)
        self._out_chunks = np.zeros(max_chunks, np.int32)
        self.slow_lock = threading.RLock()  # the hook's slow path and this class's calls
        self.large.base = self.small.base = None  # reserved at first use (reserve_ranges)
        self.large.nbytes, self.small.nbytes = va_bytes, small_va_bytes
        # how the Python path served requests ("fast": pages already mapped); the PyTorch hook's
        # compiled fast path counts in g (native_torch.G_COUNTERS) instead
        self.counts = {"fast": 0, "mapped": 0, "pages_mapped": 0, "pages_reclaimed": 0, "chunks_created": 0,
                       "reclaims": 0, "chunks_lent": 0, "pages_remapped": 0}

    def _allocate(self, size: int, stream: int) -> int:
        return self.alloc_block(size, stream)

    def compiled_replay(self, events: ReplayArrays) -> CompiledReplay:
        """The heap's decisions in one compiled loop, the driver work through this class's own
        methods: :mod:`vmstoolkit.pools.paged.replay`. Runtime complexity:
        :func:`~vmstoolkit.pools.paged.replay.replay_paged`'s, O(E log(E)) for E events plus the
        heap's work per event and the driver calls of the blocks that need pages."""
        from vmstoolkit.pools.paged.replay import replay_paged

        if self._closed:
            raise AllocatorClosedError(f"{self.name}: compiled_replay after close(): the allocator is closed")
        return replay_paged(self, events)

    def _free(self, addr: int) -> None:
        freed = self.free_block(addr)
        assert freed, f"paged: no live block at {addr:#x}"

    def _free_streamed(self, addr: int, size: int, stream: int | None) -> None:
        own = self._streams.stream_of.pop(addr, self._streams.home)
        bits = self.slot_bit(own if own is not None else 0)
        if stream is not None:
            bits |= self.slot_bit(stream)
        freed = self.free_block(addr, bits)
        assert freed, f"paged: no live block at {addr:#x}"

    def record_stream(self, addr: int, stream: int) -> None:
        """:meth:`Allocator.record_stream`: the stream's tag bit is added to the block's record
        (:meth:`record_block`); its free then tags the block's chunks with it, so that a later taker
        on another stream orders after that work. Runtime complexity: O(1)."""
        addr, stream = self._address(addr, "record_stream"), self._stream(stream, "record_stream")
        if addr not in self._live:
            raise InvalidFreeError(f"record_stream of address {addr:#x}, which is not a live allocation")
        self.record_block(addr, stream)

    def path_counts(self) -> dict:
        """``counts`` with the mapped placement's searches (requests whose best fit lacked chunks)
        and the blocks those searches visited, counted by the compiled heap. Runtime complexity:
        O(1) (a fixed set of counters)."""
        return {**self.counts, "placement_searches": int(self.large.meta[H.M_SCANS]),
                "blocks_searched": int(self.large.meta[H.M_SCANNED])}

    # -- caches ----------------------------------------------------------------------------
    def _empty_cache(self) -> None:
        """Unmap every page no live block uses and release every free chunk."""
        with self.slow_lock:
            self._repair()
            self.graveyard.retry()
            self._reclaim(len(self._out_pages))
            while self.g[H.G_FREE_CHUNKS] > 0:
                cid = int(self.chunk_stack[self.g[H.G_FREE_CHUNKS] - 1])
                self.driver.release(self.handles[cid])  # raises before the state changes
                self.g[H.G_FREE_CHUNKS] -= 1
                self.g[H.G_TOTAL_CHUNKS] -= 1
                self.handles[cid] = None
                self._spare_ids.append(cid)

    def close(self) -> None:
        """:meth:`Allocator.close`, then the two virtual ranges given back (a failed step stays in the
        graveyard; a second close retries it). Runtime complexity: O(live) frees, O(pages + chunks) for
        the cache, two driver calls for the ranges."""
        super().close()
        steps = []
        for h in (self.large, self.small):
            if getattr(h, "base", None) is not None:
                steps.append(("free_address", h.base, h.nbytes))
                h.base = None
        self.graveyard.run(steps)  # a failed step stays in the graveyard: a second close retries it

    def reset_peak_stats(self) -> None:
        """:meth:`Allocator.reset_peak_stats`, and the live-page peak (which bounds new chunks) started
        again from the live pages. Runtime complexity: O(1)."""
        super().reset_peak_stats()
        self.g[H.G_PEAK_LIVE_PAGES] = self.g[H.G_LIVE_PAGES]

    def _check(self) -> None:
        super()._check()
        for name, h in (("large", self.large), ("small", self.small)):
            code = H.check_heap(*h.arrays())
            assert code == 0, f"paged: {name} heap invariant {code} broken"
        g = self.g
        size = self.nmaps.shape[0]
        maps = np.zeros(size, np.int64)
        live = np.zeros(size, np.int64)
        for h in (self.large, self.small):
            has = h.page_chunk != H.NONE
            maps += np.bincount(h.page_chunk[has], minlength=size)
            live += np.bincount(h.page_chunk[has & (h.page_used > 0)], minlength=size)
        assert np.array_equal(maps, self.nmaps), "paged: pages mapping each chunk"
        assert np.array_equal(live, self.chunk_live), "paged: live pages mapping each chunk"
        assert live.max(initial=0) <= 1, "paged: two live pages share a chunk"
        assert self.aliases or maps.max(initial=0) <= 1, "paged: a chunk mapped twice without aliases"
        stack = self.chunk_stack[:g[H.G_FREE_CHUNKS]]
        assert not np.any(self.nmaps[stack]), "paged: a chunk on the free stack is mapped"
        mapped = int(np.count_nonzero(self.nmaps))
        assert mapped + g[H.G_FREE_CHUNKS] == g[H.G_TOTAL_CHUNKS], "paged: chunks mapped + free != chunks held"
        assert g[H.G_TOTAL_CHUNKS] * self.page == self.driver.physical_bytes, "paged: chunks held != driver's physical bytes"
        live_pages = sum(int(np.count_nonzero(h.page_used)) for h in (self.large, self.small))
        assert live_pages == g[H.G_LIVE_PAGES], "paged: live page count"
        for h in (self.large, self.small):
            assert not np.any((h.page_used > 0) & (h.page_chunk == H.NONE)), "paged: a live page has no chunk"
        if self.driver.lists_resources:  # the simulated driver's own record
            mapped = {va for va in self.driver.live_mappings() for h in (self.large, self.small)
                      if h.base is not None and h.base <= va < h.base + h.nbytes}
            books = {h.base + (int(p) << self.page_shift) for h in (self.large, self.small) if h.base is not None
                     for p in np.flatnonzero(h.page_chunk != H.NONE)}
            assert mapped == books, (f"paged: the driver maps {len(mapped - books)} pages the books do not know, "
                                     f"and the books map {len(books - mapped)} the driver does not")
        for h, p in self._stuck:
            assert h.page_chunk[p] != H.NONE and h.page_used[p] == 0, "paged: a stuck page lost its chunk or is live"
        for addr, size in self._live.items():  # every live request lies inside a live block of its own
            heap, start = self._locate(addr)
            assert heap is not None, f"paged: live allocation {addr:#x} is no block's start"
            blk = heap.block_at[start]
            assert blk != H.NONE and heap.b_free[blk] == 0, f"paged: live allocation {addr:#x} has no live block"
            assert int(heap.b_len[blk]) << heap.unit_shift >= size, f"paged: block at {addr:#x} smaller than its request {size}"
