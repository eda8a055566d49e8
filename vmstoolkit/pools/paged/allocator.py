"""``paged``: a best-fit heap over one large virtual range, physical memory mapped page by page.

Two heaps (:mod:`~vmstoolkit.pools.paged.heap`) over ranges reserved once: requests of 1 MiB or
less in 512 B units, larger ones in whole 2 MiB pages (or, with ``large_unit``, in finer units
that let neighbouring large blocks share a page: 0.1 GiB less on the traces' peaks, but a shared
page cannot be reclaimed while either block lives; on the H200's training run 512 KiB units
remapped more and reserved more than whole pages, so whole pages stay the default:
``experiments/results/paged/``, ``experiments/results/train-h200/`` run 12). A block's address never changes and a
freed block merges with its neighbours, as in a classic heap. Large blocks go first to free
pages that still have chunks (``placement="mapped"``, the default: when the best fit would need
new chunks, the lowest free window whose pages all have theirs, if any; ``"best-fit"`` ignores
mappings). On the H200 training run's own allocation sequence this leaves the driver almost no
work after each round's first, largest step, at the same peak (``experiments/results/train-h200/``
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

Peak reserved is therefore the peak number of pages live blocks touch: the largest blocks
round up to 2 MiB, small ones share pages. The decisions are compiled Numba code shared with
the PyTorch hook (:mod:`vmstoolkit.integrations.native_torch`); this class runs them from
Python and does the driver work, for replays and as the hook's slow path.
"""

from __future__ import annotations

import threading

import numpy as np

from vmstoolkit.errors import ConfigError, DriverError, DriverOutOfMemoryError, OutOfMemoryError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.driver import VMMDriver
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.units import GiB, MiB

SMALL_SIZE = 1 * MiB
SMALL_UNIT_SHIFT = 9  # 512 B, PyTorch's rounding


@register_allocator("paged", "best-fit heap over one virtual range; 2 MiB pages mapped on demand, reclaimed at the peak")
class PagedAllocator(Allocator):
    name = "paged"

    def __init__(self, driver: VMMDriver, *, va_bytes: int | None = None, small_va_bytes: int = 4 * GiB,
                 slack_pages: int = 0, reclaim: str = "top-down", reclaim_batch: int = 16,
                 placement: str = "mapped", aliases: bool = False, large_unit: int | None = None,
                 max_blocks: int = 1 << 18) -> None:
        super().__init__(driver)
        page = driver.granularity
        if page & (page - 1) or page < (1 << SMALL_UNIT_SHIFT):
            raise ConfigError(f"paged: the granularity {page} is not a power of two of at least 512 B")
        if slack_pages < 0:
            raise ConfigError(f"paged: slack_pages must be >= 0, got {slack_pages}")
        if reclaim_batch < 1:
            raise ConfigError(f"paged: reclaim_batch must be >= 1, got {reclaim_batch}")
        self.reclaim_batch = reclaim_batch
        if reclaim not in ("top-down", "clock"):
            raise ConfigError(f"paged: reclaim must be 'top-down' or 'clock', got {reclaim!r}")
        if placement not in ("best-fit", "mapped"):
            raise ConfigError(f"paged: placement must be 'best-fit' or 'mapped', got {placement!r}")
        self.page = page
        self.page_shift = page.bit_length() - 1
        va_bytes = va_bytes or 2 * -(-driver.capacity // page) * page
        if va_bytes % page or small_va_bytes % page or va_bytes <= 0 or small_va_bytes <= 0:
            raise ConfigError(f"paged: virtual ranges ({va_bytes}, {small_va_bytes} bytes) must be positive multiples of {page}")
        large_unit = large_unit or page
        if large_unit & (large_unit - 1) or not (1 << SMALL_UNIT_SHIFT) <= large_unit <= page:
            raise ConfigError(f"paged: large_unit must be a power of two from 512 B to the page ({page}), got {large_unit}")
        large_shift = large_unit.bit_length() - 1
        max_chunks = va_bytes // page + small_va_bytes // page
        self.aliases = aliases
        self.chunk_live = np.zeros(max_chunks, np.int32)  # per chunk id: live pages mapping it (0 or 1)
        self.nmaps = np.zeros(max_chunks, np.int32)  # per chunk id: pages mapping it (more than one: aliases)
        self._lend_hand = np.zeros(1, np.int64)
        self.large = H.Heap(va_bytes >> large_shift, large_shift, self.page_shift, buckets=4096, max_blocks=max_blocks,
                            chunk_live=self.chunk_live)
        self.small = H.Heap(small_va_bytes >> SMALL_UNIT_SHIFT, SMALL_UNIT_SHIFT, self.page_shift,
                            buckets=(SMALL_SIZE >> SMALL_UNIT_SHIFT) + 1, max_blocks=max_blocks,
                            chunk_live=self.chunk_live)
        for h in (self.large, self.small):
            h.meta[H.M_CLOCK_ORDER] = reclaim == "clock"
        self.large.meta[H.M_PLACE_MAPPED] = placement == "mapped"
        self.g = np.zeros(16, np.int64)  # heap.G_* slots, then the PyTorch hook's counters
        self.g[H.G_SLACK] = slack_pages
        self.chunk_stack = np.zeros(max_chunks, np.int32)
        self.handles: list = []  # chunk id -> driver handle (None once released)
        self._spare_ids: list[int] = []
        self._out_pages = np.zeros(max_chunks, np.int64)
        self._out_chunks = np.zeros(max_chunks, np.int32)
        self.slow_lock = threading.RLock()  # the hook's slow path and this class's calls
        self.large.base = self.small.base = None  # reserved at first use (reserve_ranges)
        self.large.nbytes, self.small.nbytes = va_bytes, small_va_bytes
        # how the Python path served requests ("fast": pages already mapped); the PyTorch hook's
        # compiled fast path counts in g (native_torch.G_ALLOCS) instead
        self.counts = {"fast": 0, "mapped": 0, "pages_mapped": 0, "pages_reclaimed": 0, "chunks_created": 0,
                       "reclaims": 0, "chunks_lent": 0, "pages_remapped": 0}

    def reserve_ranges(self) -> None:
        """Reserve both heaps' virtual ranges (once; both or neither)."""
        if self.large.base is not None:
            return
        large = self.driver.reserve(self.large.nbytes)
        try:
            self.small.base = self.driver.reserve(self.small.nbytes)
        except DriverError:
            self.driver.free_address(large, self.large.nbytes)
            raise
        self.large.base = large

    # -- allocate and free (the Allocator protocol; the PyTorch hook's slow path) ---------------
    def alloc_block(self, size: int) -> int:
        """Address of a new block for ``size`` bytes, its pages mapped; raises
        :class:`~vmstoolkit.errors.OutOfMemoryError` (nothing changed) when it cannot."""
        with self.slow_lock:
            try:
                self.reserve_ranges()
            except DriverOutOfMemoryError as e:
                raise OutOfMemoryError(f"paged: cannot reserve its virtual ranges for a request of {size} bytes: {e}",
                                       requested=size, reserved=self.driver.physical_bytes,
                                       capacity=self.driver.capacity) from None
            heap = self.small if size <= SMALL_SIZE else self.large
            n = -(-size // (1 << heap.unit_shift))
            start, missing = H.heap_alloc(*heap.arrays(), self.g, n)
            if start < 0 and heap is self.small:  # the small range is full: a page of the large one
                heap = self.large
                n = -(-size // (1 << heap.unit_shift))
                start, missing = H.heap_alloc(*heap.arrays(), self.g, n)
            if start < 0:
                raise OutOfMemoryError(
                    f"paged: no free range of {n << heap.unit_shift} bytes left in the {heap.nbytes}-byte virtual range "
                    f"(request {size}); raise va_bytes", requested=size, reserved=self.driver.physical_bytes,
                    capacity=self.driver.capacity)
            if missing:
                self.map_block(heap, start, n, size)
            else:
                self.counts["fast"] += 1
            return heap.base + (start << heap.unit_shift)

    def free_block(self, addr: int) -> bool:
        """Free the live block at ``addr``; False (nothing changed) if no live block starts there."""
        with self.slow_lock:
            for heap in (self.large, self.small):
                if heap.base is not None and heap.base <= addr < heap.base + heap.nbytes:
                    return H.heap_free(*heap.arrays(), self.g, (addr - heap.base) >> heap.unit_shift) > 0
            return False

    def free_untracked(self) -> int:
        """Free every live block that ``alloc_block``'s callers still hold (the compiled hook's,
        which the Python bookkeeping never sees); returns how many. Before ``close`` when the
        hook's user is gone: closing then unmaps and releases everything."""
        n = 0
        with self.slow_lock:
            for heap in (self.large, self.small):
                if heap.base is None:
                    continue
                for start in H.live_starts(heap.b_start, heap.b_free, heap.b_next, heap.block_at):
                    if heap.base + (int(start) << heap.unit_shift) not in self._live:  # close frees those
                        n += H.heap_free(*heap.arrays(), self.g, start) > 0
        return n

    def _allocate(self, size: int, stream: int) -> int:
        return self.alloc_block(size)

    def _free(self, addr: int) -> None:
        freed = self.free_block(addr)
        assert freed, f"paged: no live block at {addr:#x}"

    def path_counts(self) -> dict:
        """``counts`` with the mapped placement's searches (requests whose best fit lacked chunks)
        and the blocks those searches visited, counted by the compiled heap."""
        return {**self.counts, "placement_searches": int(self.large.meta[H.M_SCANS]),
                "blocks_searched": int(self.large.meta[H.M_SCANNED])}

    # -- driver work -----------------------------------------------------------------------
    def map_block(self, heap: H.Heap, start: int, n: int, size: int) -> None:
        """Give the pages of the committed block at unit ``start`` their chunks; on failure the
        block is freed again and nothing stays mapped for it."""
        first, last = H.pages_of(heap.meta, start, n)
        need = 0
        try:
            # pages whose chunk is live through another mapping (an alias) lose it first
            kc = H.conflicts(heap.meta, heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack,
                             self.g, start, n, self._out_pages, self._out_chunks)
            if kc:
                self._unmap_detached(heap, kc)
                self.counts["pages_remapped"] += kc
            need = int(np.count_nonzero(heap.page_chunk[first:last] == H.NONE))
            self._provide_chunks(need)
            k = H.assign_chunks(heap.meta, heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps,
                                self.chunk_stack, self.g, first, last, self._out_pages, self._out_chunks)
            assert k == need, "paged: chunks provided but not assigned"
            self._map_pages(heap, k)
        except (DriverError, OutOfMemoryError) as e:
            H.settle_stack(self.nmaps, self.chunk_stack, self.g)
            H.heap_free(*heap.arrays(), self.g, start)
            if isinstance(e, DriverOutOfMemoryError):
                raise OutOfMemoryError(
                    f"paged: out of memory for a request of {size} bytes ({need} new pages of {self.page}) with "
                    f"{self.driver.physical_bytes} bytes in use: {e}", requested=size,
                    reserved=self.driver.physical_bytes, capacity=self.driver.capacity) from None
            raise
        H.settle_stack(self.nmaps, self.chunk_stack, self.g)
        self.counts["mapped"] += 1
        self.counts["pages_mapped"] += k

    def _provide_chunks(self, need: int) -> None:
        """Make at least ``need`` chunks free: new ones within the peak, reclaimed ones, new ones."""
        g = self.g
        short = need - int(g[H.G_FREE_CHUNKS])
        if short <= 0:
            return
        cap = max(int(g[H.G_PEAK_LIVE_PAGES]), int(g[H.G_LIVE_PAGES])) + int(g[H.G_SLACK])
        within = min(short, max(0, cap - int(g[H.G_TOTAL_CHUNKS])))
        short -= self._create(within, must=False)
        if short > 0 and self.aliases:
            # chunks mapped only where nothing is live: map them here too, unmapping nothing
            lent = H.lend_idle(self.chunk_live, self.nmaps, len(self.handles), self.chunk_stack, g, self._lend_hand, short)
            self.counts["chunks_lent"] += lent
            short -= lent
        if short > 0 and not self.aliases:
            # at least reclaim_batch pages per synchronize: the spare chunks serve the next
            # requests without another one (16: 2-4x fewer syncs on the traces for 0-6% more
            # driver time, experiments/results/paged/)
            short -= self._reclaim(max(short, self.reclaim_batch))
        if short > 0:
            self._create(short, must=True)  # a new peak

    def _create(self, count: int, must: bool) -> int:
        made = 0
        for _ in range(count):
            try:
                h = self.driver.create(self.page)
            except DriverOutOfMemoryError:
                if must:
                    raise
                break
            cid = self._spare_ids.pop() if self._spare_ids else len(self.handles)
            if cid == len(self.handles):
                self.handles.append(h)
            else:
                self.handles[cid] = h
            self.chunk_stack[self.g[H.G_FREE_CHUNKS]] = cid
            self.g[H.G_FREE_CHUNKS] += 1
            self.g[H.G_TOTAL_CHUNKS] += 1
            made += 1
        self.counts["chunks_created"] += made
        return made

    def _reclaim(self, want: int) -> int:
        """Unmap up to ``want`` pages no live block uses; returns how many chunks that frees
        (fewer than the pages when some were aliases of chunks still mapped elsewhere)."""
        g = self.g
        before = int(g[H.G_FREE_CHUNKS])
        pages = 0
        synced = False
        for heap in (self.large, self.small):
            if pages == want:
                break
            if not synced:
                # Work already queued may still use a free block's pages (PyTorch frees when the
                # last reference goes, not when the stream is done): wait for it before unmapping.
                self.driver.synchronize()
                synced = True
            k = H.reclaim(heap.meta, heap.page_chunk, heap.page_used, self.nmaps, self.chunk_stack, g, want - pages,
                          self._out_pages, self._out_chunks)
            self._unmap_detached(heap, k, synced=True)
            pages += k
        self.counts["pages_reclaimed"] += pages
        self.counts["reclaims"] += 1
        return int(g[H.G_FREE_CHUNKS]) - before

    def _unmap_detached(self, heap: H.Heap, k: int, synced: bool = False) -> None:
        """Unmap the ``k`` pages whose chunks :func:`~heap.reclaim` or :func:`~heap.conflicts`
        just took off (after a synchronize unless ``synced``); on a driver error the pages not yet
        unmapped get their chunks back and the error is raised."""
        pages, chunks = self._out_pages[:k].copy(), self._out_chunks[:k].copy()
        if k and not synced:
            self.driver.synchronize()  # queued work may still use these pages (see _reclaim)
        for i, p in enumerate(pages.tolist()):
            try:
                self.driver.unmap(heap.base + (p << self.page_shift), self.page)
            except DriverError:
                H.reattach(heap.meta, heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack,
                           self.g, pages, chunks, i, k)
                raise

    def _map_pages(self, heap: H.Heap, k: int) -> None:
        """Map the ``k`` pages just assigned, then grant access run by run; undo on failure."""
        pages, chunks = self._out_pages[:k].copy(), self._out_chunks[:k].copy()
        done = 0
        try:
            for p, c in zip(pages.tolist(), chunks.tolist()):
                self.driver.map(heap.base + (p << self.page_shift), self.page, self.handles[c])
                done += 1
            i = 0
            while i < k:  # runs of consecutive pages: one set_access each
                j = i
                while j + 1 < k and pages[j + 1] == pages[j] + 1:
                    j += 1
                self.driver.set_access(heap.base + (int(pages[i]) << self.page_shift), (j - i + 1) * self.page)
                i = j + 1
        except DriverError:
            for p in pages[:done].tolist():
                try:
                    self.driver.unmap(heap.base + (p << self.page_shift), self.page)
                except DriverError:
                    pass
            H.unassign(heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack, self.g, pages, k)
            raise

    # -- caches ----------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Unmap every page no live block uses and release every free chunk."""
        with self.slow_lock:
            self._reclaim(len(self._out_pages))
            while self.g[H.G_FREE_CHUNKS] > 0:
                cid = int(self.chunk_stack[self.g[H.G_FREE_CHUNKS] - 1])
                self.driver.release(self.handles[cid])  # raises before the state changes
                self.g[H.G_FREE_CHUNKS] -= 1
                self.g[H.G_TOTAL_CHUNKS] -= 1
                self.handles[cid] = None
                self._spare_ids.append(cid)

    def close(self) -> None:
        super().close()
        for h in (self.large, self.small):
            if getattr(h, "base", None) is not None:
                self.driver.free_address(h.base, h.nbytes)
                h.base = None

    def reset_peak_stats(self) -> None:
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
