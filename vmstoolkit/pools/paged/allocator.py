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
"""

from __future__ import annotations

import threading

import numpy as np

from vmstoolkit.errors import (
    AllocatorClosedError,
    DriverError,
    DriverOutOfMemoryError,
    InvalidFreeError,
    OutOfMemoryError,
)
from vmstoolkit.pools.base import Allocator, CompiledReplay, ReplayArrays
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.options import PagedOptions
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.drivers.teardown import Graveyard

from vmstoolkit.pools.paged.heap import (  # noqa: F401 - the allocator's constants, defined beside the heap
    G_NSLOTS, MAX_SLOTS, MIN_BLOCKS, OVERFLOW_BIT, SMALL_SIZE, SMALL_UNIT_SHIFT,
)


@register_allocator("paged", PagedOptions, "best-fit heap over one virtual range; 2 MiB pages mapped on demand, reclaimed at the peak")
class PagedAllocator(Allocator):
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
            try:
                self.graveyard.run([("free_address", large, self.large.nbytes)])
            except DriverError:
                pass  # the graveyard keeps it for empty_cache/close
            raise
        self.large.base = large

    # -- allocate and free (the Allocator protocol; the PyTorch hook's slow path) ---------------
    def alloc_block(self, size: int, stream: int = 0) -> int:
        """Address of a new block for ``size`` bytes on ``stream``, its pages mapped and the stream
        ordered after any other stream's queued work on its chunks; raises
        :class:`~vmstoolkit.errors.OutOfMemoryError` (nothing changed) when it cannot."""
        with self.slow_lock:
            heap, start, missing = self.place_block(size)
            return self.finish_block(heap, start, size, missing, stream)

    def place_block(self, size: int) -> tuple[H.Heap, int, int]:
        """Commit a block for ``size`` bytes in the heaps (no driver work but reserving the
        ranges at first use): ``(heap, start unit, pages it still needs chunks for)``."""
        with self.slow_lock:
            self._repair()
            if size > self.large.nbytes:  # sizes the heap cannot represent: an OOM, never a wrapped size
                raise OutOfMemoryError(
                    f"paged: a request of {size} bytes is larger than the {self.large.nbytes}-byte virtual range "
                    f"(the device has {self.driver.capacity})", requested=size,
                    reserved=self.driver.physical_bytes, capacity=self.driver.capacity)
            try:
                self.reserve_ranges()
            except DriverOutOfMemoryError as e:
                raise OutOfMemoryError(f"paged: cannot reserve its virtual ranges for a request of {size} bytes: {e}",
                                       requested=size, reserved=self.driver.physical_bytes,
                                       capacity=self.driver.capacity) from None
            heap = self.small if size <= SMALL_SIZE else self.large
            start, missing = self._commit(heap, size)
            if start < 0 and heap is self.small:  # the small range is full: a page of the large one
                heap = self.large
                start, missing = self._commit(heap, size)
            if start < 0:
                n = -(-size // (1 << heap.unit_shift))
                raise OutOfMemoryError(
                    f"paged: no free range of {n << heap.unit_shift} bytes left in the {heap.nbytes}-byte virtual range "
                    f"(request {size}); raise va_bytes", requested=size, reserved=self.driver.physical_bytes,
                    capacity=self.driver.capacity)
            return heap, start, missing

    def finish_block(self, heap: H.Heap, start: int, size: int, missing: int, stream: int) -> int:
        """The driver work of the block :meth:`place_block` committed at unit ``start`` (map the
        ``missing`` pages, order ``stream`` after other streams' work on its chunks); its address.
        Raises :class:`~vmstoolkit.errors.OutOfMemoryError` with the block freed again. Also the
        slow step of the compiled replay (:mod:`vmstoolkit.pools.paged.replay`)."""
        with self.slow_lock:
            n = -(-size // (1 << heap.unit_shift))
            if missing:
                self.map_block(heap, start, n, size)
            else:
                self.counts["fast"] += 1
            self.order_after(heap, start, n, stream)
            return heap.base + (start << heap.unit_shift)

    def _commit(self, heap: H.Heap, size: int) -> tuple[int, int]:
        """``heap_alloc`` for ``size`` bytes, growing the block records when they run out."""
        n = -(-size // (1 << heap.unit_shift))
        while True:
            start, missing = H.heap_alloc(*heap.arrays(), self.g, n)
            if start != H.NO_RECORD:
                return start, missing
            heap.grow_records()
            if self.on_arrays_changed is not None:
                self.on_arrays_changed()

    def free_block(self, addr: int, bits: int = 1) -> bool:
        """Free the live block that starts at ``addr`` (its chunks tagged with the streams
        ``bits``); False, nothing changed, if no live block starts exactly there."""
        with self.slow_lock:
            heap, start = self._locate(addr)
            return heap is not None and H.heap_free(*heap.arrays(), self.g, start, bits) > 0

    def _locate(self, addr: int) -> tuple[H.Heap | None, int]:
        """The heap and unit of a block start at ``addr`` (None for an address inside a unit,
        outside both heaps, or before they exist)."""
        for heap in (self.large, self.small):
            if heap.base is not None and heap.base <= addr < heap.base + heap.nbytes:
                off = addr - heap.base
                if off & ((1 << heap.unit_shift) - 1):
                    return None, -1  # an interior pointer is no block's start
                return heap, off >> heap.unit_shift
        return None, -1

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
                        n += H.heap_free(*heap.arrays(), self.g, start, 1) > 0
        return n

    def _allocate(self, size: int, stream: int) -> int:
        return self.alloc_block(size, stream)

    def compiled_replay(self, events: ReplayArrays) -> CompiledReplay:
        """The heap's decisions in one compiled loop, the driver work through this class's own
        methods: :mod:`vmstoolkit.pools.paged.replay`."""
        from vmstoolkit.pools.paged.replay import replay_paged

        if self._closed:
            raise AllocatorClosedError(f"{self.name}: compiled_replay after close(): the allocator is closed")
        return replay_paged(self, events)

    def _free(self, addr: int) -> None:
        freed = self.free_block(addr)
        assert freed, f"paged: no live block at {addr:#x}"

    # -- streams: chunks tagged with the streams that may still use them ------------------------
    # A freed block's chunks carry the bits of its streams (its own and those recorded on it). A
    # block handed to another stream first makes that stream wait for an event on each tagged
    # stream (cuStreamWaitEvent: the GPU orders the work, the host never waits), so memory is
    # reused across streams at once and safely; the same stream needs nothing. A device
    # synchronize (reclaim) clears every tag.

    def slot_bit(self, stream: int) -> int:
        """The stream's bit in chunk tags (slots are handed out in order of first use; streams
        past the 62nd share bit 62, which waits for the whole device)."""
        slot = self._slot.get(stream)
        if slot is None:
            k = int(self.g[G_NSLOTS])
            slot = min(k, MAX_SLOTS - 1)
            if k < MAX_SLOTS:
                self.stream_slots[k] = stream
                self.g[G_NSLOTS] = k + 1
            self._slot[stream] = slot
        return 1 << slot

    def order_after(self, heap: H.Heap, start: int, n: int, stream: int) -> None:
        """Make ``stream`` wait for every other stream whose queued work may use the chunks of
        the block at unit ``start`` (see :func:`~vmstoolkit.pools.paged.heap.take_tags`)."""
        bit = self.slot_bit(stream)
        mine = 0 if bit == OVERFLOW_BIT else bit
        w = int(H.take_tags(heap.meta, heap.page_chunk, heap.page_used, self.chunk_tag, start, n, mine))
        if w:
            self.wait_for(stream, w)

    def wait_for(self, stream: int, mask: int) -> None:
        """``stream`` waits for the work queued so far on the streams of ``mask``."""
        if mask & OVERFLOW_BIT:  # streams without a slot of their own: wait for the whole device
            self.driver.synchronize()
            self.chunk_tag[:] = 0
            return
        for slot in range(MAX_SLOTS - 1):
            if mask >> slot & 1:
                ev = self.driver.record_event(int(self.stream_slots[slot]))
                try:
                    if not self.driver.event_done(ev):
                        self.driver.stream_wait(stream, ev)
                finally:
                    self.driver.release_event(ev)

    def _free_streamed(self, addr: int, size: int, stream: int | None) -> None:
        own = self._streams.stream_of.pop(addr, self._streams.home)
        bits = self.slot_bit(own if own is not None else 0)
        if stream is not None:
            bits |= self.slot_bit(stream)
        freed = self.free_block(addr, bits)
        assert freed, f"paged: no live block at {addr:#x}"

    def record_stream(self, addr: int, stream: int) -> None:
        addr = self._address(addr, "record_stream")
        if addr not in self._live:
            raise InvalidFreeError(f"record_stream of address {addr:#x}, which is not a live allocation")
        self.record_block(addr, stream)

    def record_block(self, addr: int, stream: int) -> bool:
        """Add ``stream`` to the streams of the live block at ``addr`` (False: none starts there)."""
        with self.slow_lock:
            heap, start = self._locate(addr)
            return heap is not None and bool(H.record_on(heap.meta, heap.b_free, heap.block_at, heap.b_rec, start,
                                                         self.slot_bit(stream)))

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
            H.heap_free(*heap.arrays(), self.g, start, 0)
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
            # driver time, docs/results.md#paged-policy)
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
            self.chunk_tag[cid] = 0
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
                self.chunk_tag[:] = 0  # nothing queued uses any chunk now
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
            self.chunk_tag[:] = 0
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
            # Undo: unmap what was mapped. A page whose unmap fails too stays mapped, so it keeps
            # its chunk in the books (the driver's truth) and waits in ``_stuck`` for _repair;
            # until then every allocation takes the slow path, which repairs first.
            undo = [p for p in pages[done:].tolist()]
            for p in pages[:done].tolist():
                try:
                    self.driver.unmap(heap.base + (p << self.page_shift), self.page)
                    undo.append(p)
                except DriverError:
                    self._stick(heap, p)
            gone = np.array(undo, np.int64)
            H.unassign(heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack, self.g,
                       gone, len(undo))
            raise

    def _stick(self, heap: H.Heap, p: int) -> None:
        if not self._stuck:
            self.g[H.G_BUSY] += 1  # the compiled fast path defers to Python until repaired
        self._stuck.append((heap, p))

    def _repair(self) -> None:
        """Unmap the pages a failed rollback left mapped (see :meth:`_map_pages`); those that
        still fail stay for the next try. Called first by every slow-path entry and by close."""
        if not self._stuck:
            return
        keep = []
        for heap, p in self._stuck:
            try:
                self.driver.unmap(heap.base + (p << self.page_shift), self.page)
            except DriverError:
                keep.append((heap, p))
                continue
            H.unassign(heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack, self.g,
                       np.array([p], np.int64), 1)
        H.settle_stack(self.nmaps, self.chunk_stack, self.g)
        self._stuck = keep
        if not keep:
            self.g[H.G_BUSY] -= 1

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
        super().close()
        steps = []
        for h in (self.large, self.small):
            if getattr(h, "base", None) is not None:
                steps.append(("free_address", h.base, h.nbytes))
                h.base = None
        self.graveyard.run(steps)  # a failed step stays in the graveyard: a second close retries it

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
