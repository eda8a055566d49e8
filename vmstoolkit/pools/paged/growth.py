"""``paged``'s driver work under its growth options: ``grow_pages`` (new chunks made as handles
of up to N pages, one ``cuMemCreate`` each, each page mapped at its offset; ``empty_cache``
releases whole handles only) and ``map_runs`` (a handle's consecutive new pages mapped by one
``cuMemMap``, unmapped only whole and only when none of their pages is live, never lent as
aliases). Docs: Note [grow_pages] in docs/architecture.md.

:class:`PagedGrowth` is a mixin of :class:`~vmstoolkit.pools.paged.slow_path.PagedSlowPath`,
over the state ``PagedAllocator.__init__`` builds; the slow path calls into it only when one of
the options is on, so the default's driver work is the slow path's own.
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import DriverError, DriverOutOfMemoryError
from vmstoolkit.pools.paged import heap as H


class PagedGrowth:
    """Grouped creates and mapped runs (see the module docstring)."""

    def _create_grouped(self, count: int, must: bool) -> int:
        """``_create`` with ``grow_pages``: the ``count`` chunks made as handles of up to
        ``grow_pages`` pages, one ``cuMemCreate`` each, each page of a handle a chunk id of its own
        (mapped alone, at its offset); the first page of a handle is the first taken. A handle the
        device has no room for is made again page by page (as many chunks as the default gets)."""
        made, n, page = 0, self.grow_pages, self.page
        g = self.g
        while made < count:
            k = min(n, count - made)
            try:
                h = self.driver.create(k * page)
            except DriverOutOfMemoryError:
                if k > 1:
                    n = 1
                    continue
                if must:
                    raise
                break
            self._slices[h] = k
            for i in range(k - 1, -1, -1):  # the stack is taken from the top: offset 0 last in
                cid = self._spare_ids.pop() if self._spare_ids else len(self.handles)
                if cid == len(self.handles):
                    self.handles.append(h)
                else:
                    self.handles[cid] = h
                self.chunk_off[cid] = i * page
                self.chunk_tag[cid] = 0
                self.chunk_stack[g[H.G_FREE_CHUNKS]] = cid
                g[H.G_FREE_CHUNKS] += 1
                g[H.G_TOTAL_CHUNKS] += 1
            made += k
        self.counts["chunks_created"] += made
        return made

    def _release_whole_handles(self) -> None:
        """``empty_cache``'s release with ``grow_pages``: every handle whose chunks are all on the
        free stack is released (one ``cuMemRelease``); the free chunks of a handle still mapped
        somewhere stay on the stack. A release that fails raises with the books matching the
        driver (the handles released before it are gone from both)."""
        g = self.g
        free = self.chunk_stack[:int(g[H.G_FREE_CHUNKS])].tolist()
        by: dict = {}
        for c in free:
            by.setdefault(self.handles[c], []).append(c)
        gone: list[int] = []
        try:
            for h, cids in by.items():
                if len(cids) == self._slices[h]:
                    self.driver.release(h)  # raises before the books change
                    del self._slices[h]
                    gone.extend(cids)
        finally:
            if gone:
                out = set(gone)
                keep = [c for c in free if c not in out]
                self.chunk_stack[:len(keep)] = keep
                g[H.G_FREE_CHUNKS] = len(keep)
                g[H.G_TOTAL_CHUNKS] -= len(gone)
                for c in sorted(gone, reverse=True):
                    self.handles[c] = None
                    self._spare_ids.append(c)

    def _runs_of(self, pages, chunks) -> list[tuple[int, int]]:
        """``map_runs``: ``(i, j)`` ranges of the pages just assigned that one ``cuMemMap`` maps:
        consecutive pages whose chunks are consecutive pages of one handle, mapped nowhere else."""
        out, i, k, page = [], 0, len(pages), self.page
        while i < k:
            j = i + 1
            if self.nmaps[chunks[i]] == 1:
                h = self.handles[chunks[i]]
                while (j < k and pages[j] == pages[j - 1] + 1 and self.nmaps[chunks[j]] == 1
                       and self.handles[chunks[j]] == h and self.chunk_off[chunks[j]] == self.chunk_off[chunks[j - 1]] + page):
                    j += 1
            out.append((i, j))
            i = j
        return out

    def _forget_run(self, heap: H.Heap, s: int, n: int) -> None:
        """Drop the books of the run of ``n`` pages at page ``s`` (before its chunks leave its pages)."""
        self.in_run[heap.page_chunk[s:s + n]] = 0
        heap.map_len[s] = 0
        heap.map_head[s:s + n] = H.NONE

    def _map_runs(self, heap: H.Heap, k: int) -> None:
        """``_map_pages`` with ``map_runs``: one ``cuMemMap`` per run (:meth:`_runs_of`), then access
        run by run of consecutive pages; on failure every run mapped is unmapped whole (one whose
        unmap fails too stays, as a stuck page at its first page, for :meth:`_repair`)."""
        pages, chunks = self._out_pages[:k].copy(), self._out_chunks[:k].copy()
        page, shift, base = self.page, self.page_shift, heap.base
        runs = self._runs_of(pages.tolist(), chunks.tolist())
        done = 0
        try:
            for i, j in runs:
                c, s = int(chunks[i]), int(pages[i])
                self.driver.map(base + (s << shift), (j - i) * page, self.handles[c], int(self.chunk_off[c]))
                done += 1
                if j - i > 1:
                    heap.map_len[s] = j - i
                    heap.map_head[s:s + j - i] = s
                    self.in_run[chunks[i:j]] = 1
            i = 0
            while i < k:  # runs of consecutive pages: one set_access each
                j = i
                while j + 1 < k and pages[j + 1] == pages[j] + 1:
                    j += 1
                self.driver.set_access(base + (int(pages[i]) << shift), (j - i + 1) * page)
                i = j + 1
        except DriverError:
            undo = [p for i, j in runs[done:] for p in pages[i:j].tolist()]
            for i, j in runs[:done]:
                s = int(pages[i])
                try:
                    self.driver.unmap(base + (s << shift), (j - i) * page)
                except DriverError:
                    self._stick(heap, s)
                    continue
                if j - i > 1:
                    self._forget_run(heap, s, j - i)
                undo.extend(pages[i:j].tolist())
            gone = np.array(undo, np.int64)
            H.unassign(heap.page_chunk, heap.page_used, self.chunk_live, self.nmaps, self.chunk_stack, self.g,
                       gone, len(undo))
            raise

    def _reclaim_runs(self, want: int) -> int:
        """``_reclaim`` with ``map_runs`` (after one synchronize): up to about ``want`` pages of
        mappings none of whose pages is live unmapped whole, the large heap's first, in the
        ``reclaim`` order (a run partly live stays mapped: unmapping it would unmap live pages);
        their chunks go onto the stack once mapped nowhere. Returns how many chunks that frees."""
        g = self.g
        before = int(g[H.G_FREE_CHUNKS])
        self.driver.synchronize()  # queued work may still use free blocks' pages (see _reclaim)
        self._clear_tags()
        pages = 0
        for heap in (self.large, self.small):
            if pages >= want:
                break
            if heap.base is not None:
                pages += self._reclaim_heap_runs(heap, want - pages)
        self.counts["pages_reclaimed"] += pages
        self.counts["reclaims"] += 1
        return int(g[H.G_FREE_CHUNKS]) - before

    def _reclaim_heap_runs(self, heap: H.Heap, want: int) -> int:
        pc, pu, meta = heap.page_chunk, heap.page_used, heap.meta
        stuck = {p for h, p in self._stuck if h is heap}
        clock = meta[H.M_CLOCK_ORDER] == 1
        npages = pc.shape[0]
        p = int(meta[H.M_CLOCK]) if clock else int(meta[H.M_TOP]) - 1
        got = swept = 0
        while got < want and (swept < npages if clock else p >= 0):
            if pc[p] == H.NONE:
                s, n = p, 1
            else:
                s = int(heap.map_head[p])
                s, n = (p, 1) if s == H.NONE else (s, int(heap.map_len[s]))
                if (not clock or s == p) and s not in stuck and not pu[s:s + n].any():
                    self._unmap_mapping(heap, s, n)
                    got += n
            if clock:  # on past the mapping (a sweep that starts inside a run skips the rest of it)
                swept += s + n - p
                p = s + n if s + n < npages else 0
            else:
                p = s - 1
        if clock:
            meta[H.M_CLOCK] = p
        while meta[H.M_TOP] > 0 and pc[meta[H.M_TOP] - 1] == H.NONE:
            meta[H.M_TOP] -= 1
        return got

    def _unmap_mapping(self, heap: H.Heap, s: int, n: int) -> None:
        """Unmap the mapping of ``n`` pages at page ``s`` (no page of it live), its chunks taken off
        its pages, onto the stack once mapped nowhere; raises before the books change."""
        g, pc = self.g, heap.page_chunk
        self.driver.unmap(heap.base + (s << self.page_shift), n * self.page)
        if n > 1:
            self._forget_run(heap, s, n)
        for q in range(s, s + n):
            c = int(pc[q])
            pc[q] = H.NONE
            self.nmaps[c] -= 1
            if self.nmaps[c] == 0:
                self.chunk_stack[g[H.G_FREE_CHUNKS]] = c
                g[H.G_FREE_CHUNKS] += 1
