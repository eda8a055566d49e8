"""``paged``'s slow path: placing, committing and freeing blocks, stream ordering, and the driver
work behind them (mapping pages, creating and reclaiming chunks, rollback and repair).

One of the two jobs :class:`~vmstoolkit.pools.paged.allocator.PagedAllocator` does, kept apart
from the other (the :class:`~vmstoolkit.pools.base.Allocator` protocol, in ``allocator.py``):
these are the calls the compiled paths make when the heap alone cannot serve an event, the
PyTorch hook (:mod:`vmstoolkit.integrations.native_torch`, through ``slow_lock``) and the
compiled replay (:mod:`vmstoolkit.pools.paged.replay`). :class:`PagedSlowPath` is a mixin over
the state ``PagedAllocator.__init__`` builds (heaps, chunk tables, stream slots, ``g``).
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import DriverError, DriverOutOfMemoryError, OutOfMemoryError
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.paged.heap import G_NSLOTS, MAX_SLOTS, OVERFLOW_BIT, SMALL_SIZE


class PagedSlowPath:
    """The slow-path API of ``paged`` (see the module docstring)."""


    def reserve_ranges(self) -> None:
        """Reserve both heaps' virtual ranges (once; both or neither). Cost: O(1); two
        ``cuMemAddressReserve`` calls the first time (and a ``cuMemAddressFree`` if the second
        fails), none after."""
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
        :class:`~vmstoolkit.errors.OutOfMemoryError` (nothing changed) when it cannot. Cost:
        :meth:`place_block`'s then :meth:`finish_block`'s."""
        with self.slow_lock:
            heap, start, missing = self.place_block(size)
            return self.finish_block(heap, start, size, missing, stream)

    def place_block(self, size: int) -> tuple[H.Heap, int, int]:
        """Commit a block for ``size`` bytes in the heaps (no driver work but reserving the
        ranges at first use): ``(heap, start unit, pages it still needs chunks for)``. Cost: O(pages
        of the block) plus the fit (``heap_alloc``), O(records) more when the block records grow;
        no driver call but the first use's reserves and the repair of stuck pages (one unmap each)."""
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
        slow step of the compiled replay (:mod:`vmstoolkit.pools.paged.replay`). Cost: O(pages of
        the block) and no driver call when every page has its chunk (plus :meth:`order_after`'s
        event calls); :meth:`map_block`'s otherwise."""
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
        ``bits``); False, nothing changed, if no live block starts exactly there. Cost: O(pages of
        the block) (``heap_free``; merging with both neighbours is O(1)); no driver call."""
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
        hook's user is gone: closing then unmaps and releases everything. Cost: O(blocks) plus the
        pages of the blocks freed; no driver call."""
        n = 0
        with self.slow_lock:
            for heap in (self.large, self.small):
                if heap.base is None:
                    continue
                for start in H.live_starts(heap.b_start, heap.b_free, heap.b_next, heap.block_at):
                    if heap.base + (int(start) << heap.unit_shift) not in self._live:  # close frees those
                        n += H.heap_free(*heap.arrays(), self.g, start, 1) > 0
        return n

    # -- streams: chunks tagged with the streams that may still use them ------------------------
    # A freed block's chunks carry the bits of its streams (its own and those recorded on it). A
    # block handed to another stream first makes that stream wait for an event on each tagged
    # stream (cuStreamWaitEvent: the GPU orders the work, the host never waits), so memory is
    # reused across streams at once and safely; the same stream needs nothing. A device
    # synchronize (reclaim) clears every tag.

    def slot_bit(self, stream: int) -> int:
        """The stream's bit in chunk tags (slots are handed out in order of first use; streams
        past the 62nd share bit 62, which waits for the whole device). Cost: O(1); no driver call."""
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
        the block at unit ``start`` (see :func:`~vmstoolkit.pools.paged.heap.take_tags`). Cost:
        O(pages of the block) plus :meth:`wait_for`'s when another stream's tag is found."""
        bit = self.slot_bit(stream)
        mine = 0 if bit == OVERFLOW_BIT else bit
        w = int(H.take_tags(heap.meta, heap.page_chunk, heap.page_used, self.chunk_tag, start, n, mine))
        if w:
            self.wait_for(stream, w)

    def wait_for(self, stream: int, mask: int) -> None:
        """``stream`` waits for the work queued so far on the streams of ``mask``. Cost: O(62) for
        the slot scan; per stream in ``mask`` one ``record_event``, one ``event_done`` (never
        blocks) and, unless it is done, one ``stream_wait`` (the host never waits); with the
        overflow bit instead one ``synchronize``, which blocks the host, and O(chunks) to clear tags."""
        if mask & OVERFLOW_BIT:  # streams without a slot of their own: wait for the whole device
            self.driver.synchronize()
            self._clear_tags()
            return
        for slot in range(MAX_SLOTS - 1):
            if mask >> slot & 1:
                ev = self.driver.record_event(int(self.stream_slots[slot]))
                try:
                    if not self.driver.event_done(ev):
                        self.driver.stream_wait(stream, ev)
                finally:
                    self.driver.release_event(ev)

    def _clear_tags(self) -> None:
        """No stream's queued work uses any chunk (after a synchronize): every tag cleared. Only
        chunk ids handed out can carry one (a new chunk starts untagged): the whole table was
        a memset of 8 bytes per page of the range at every reclaim (1.1 MB on the H200; 10-20% of
        the compiled replay's time at 500k events)."""
        self.chunk_tag[:len(self.handles)] = 0

    def record_block(self, addr: int, stream: int) -> bool:
        """Add ``stream`` to the streams of the live block at ``addr`` (False: none starts there).
        Cost: O(1); no driver call."""
        with self.slow_lock:
            heap, start = self._locate(addr)
            return heap is not None and bool(H.record_on(heap.meta, heap.b_free, heap.block_at, heap.b_rec, start,
                                                         self.slot_bit(stream)))

    # -- driver work -----------------------------------------------------------------------
    def map_block(self, heap: H.Heap, start: int, n: int, size: int) -> None:
        """Give the pages of the committed block at unit ``start`` their chunks; on failure the
        block is freed again and nothing stays mapped for it. Cost: O(pages of the block) plus the
        driver calls: for k pages without a chunk, k ``cuMemMap`` (each chunk is one handle, mapped
        whole: Note [whole handles]) and one ``cuMemSetAccess`` per run of consecutive pages; one
        ``cuMemCreate`` per chunk made; pages whose chunk is an alias
        elsewhere one ``cuMemUnmap`` each after one synchronize; a reclaim (when chunks run short,
        no aliases) one synchronize and one ``cuMemUnmap`` per page reclaimed."""
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
            err = self.mapping_failed(heap, start, size, need, e)
            if err is e:
                raise
            raise err from None
        H.settle_stack(self.nmaps, self.chunk_stack, self.g)
        self.counts["mapped"] += 1
        self.counts["pages_mapped"] += k

    def mapping_failed(self, heap: H.Heap, start: int, size: int, need: int, e: Exception) -> Exception:
        """After :meth:`map_block` (or the compiled replay's, :mod:`~vmstoolkit.pools.paged.driver_work`)
        failed with ``e`` on the block at unit ``start`` that needed ``need`` pages: the block
        freed again; the error to raise (a driver's out of memory as the allocator's). Cost: O(pages
        of the block + chunks on the free stack); no driver call."""
        H.settle_stack(self.nmaps, self.chunk_stack, self.g)
        H.heap_free(*heap.arrays(), self.g, start, 0)
        if isinstance(e, DriverOutOfMemoryError):
            return OutOfMemoryError(
                f"paged: out of memory for a request of {size} bytes ({need} new pages of {self.page}) with "
                f"{self.driver.physical_bytes} bytes in use: {e}", requested=size,
                reserved=self.driver.physical_bytes, capacity=self.driver.capacity)
        return e

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
                self._clear_tags()  # nothing queued uses any chunk now
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
            self._clear_tags()
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
