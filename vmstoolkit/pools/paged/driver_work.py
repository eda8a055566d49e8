"""``paged``'s driver work in compiled code, for the compiled replay over the compiled simulated
driver: what :meth:`~vmstoolkit.pools.paged.slow_path.PagedSlowPath.map_block` and its helpers
(``_provide_chunks``, ``_create``, ``_reclaim``, ``_map_pages``) do, step for step, calling the
driver's ``njit`` operations (:mod:`vmstoolkit.pools.drivers.compiled`) on its tables directly.

The Python methods stay the reference and serve every other case: the real driver, the Python
reference driver, ``aliases=True``, planned faults, queued work, spare chunk ids (after
``empty_cache``), a table without room. Here, without aliases, no page's chunk is live through
another mapping (a chunk maps at most one page), so ``map_block``'s conflicts step finds none
and is left out. :func:`map_block` keeps its counts in ``w`` (the ``W_*`` slots) and the new
chunks' handles in ``hnd``; the replay hands both back to the driver
(:meth:`~vmstoolkit.pools.drivers.compiled.CompiledSimulatedDriver.account_compiled`) and to
the allocator whenever it returns to Python. The results are the Python path's to the byte:
``tests/pools/paged/test_paged_replay.py`` compares the allocator's and the driver's state.

Cost per block that needs pages: one compiled call per driver call (a bisection of the
driver's tables each) where the Python path made a Python call through the driver's template
and a return from the replay loop (about 5 us, plus 2-3 us per driver call).
"""

from __future__ import annotations

import numpy as np

from vmstoolkit._jit import njit
from vmstoolkit.pools.drivers import compiled as CD
from vmstoolkit.pools.paged import heap as H

# w[] slots: driver calls (failed ones included) and the allocator's counts since the last
# hand-back; the physical bytes now; the next chunk id (chunk ids are handed out in order: no spare ids)
W_CREATE, W_MAP, W_UNMAP, W_ACCESS, W_SYNCS, W_PHYS, W_NEXT_ID = 0, 1, 2, 3, 4, 5, 6
W_CHUNKS_CREATED, W_MAPPED, W_PAGES_MAPPED, W_PAGES_RECLAIMED, W_RECLAIMS = 7, 8, 9, 10, 11
W_ERROR, W_ERROR_VA = 12, 13  # a driver error's code (compiled.py's E_*) and the address it names
W_SIZE = 14
# map_block's results
MAPPED, NO_ROOM, OOM, DRIVER_ERROR = 0, 1, 2, 3


@njit(cache=True)
def _sync(w, chunk_tag):
    """``driver.synchronize()`` (no work is queued) and every chunk tag cleared, as the Python
    path (``_clear_tags``: the ids handed out)."""
    w[W_SYNCS] += 1
    chunk_tag[:w[W_NEXT_ID]] = 0


@njit(cache=True)
def _create(DS, DH, g, chunk_tag, chunk_stack, hnd, w, page, count):
    """``_create(count)``: up to ``count`` new chunks on the free stack; ``(made, code)`` with the
    driver's code of the create that failed (0: none)."""
    for i in range(count):
        w[W_CREATE] += 1
        code = CD._create(DS, DH, page)
        if code != CD.OK:
            return i, code
        cid = w[W_NEXT_ID]
        w[W_NEXT_ID] = cid + 1
        hnd[cid] = DS[CD.S_E0]
        chunk_tag[cid] = 0
        chunk_stack[g[H.G_FREE_CHUNKS]] = cid
        g[H.G_FREE_CHUNKS] += 1
        g[H.G_TOTAL_CHUNKS] += 1
        w[W_PHYS] += page
    return count, CD.OK


@njit(cache=True)
def _unmap_pages(DS, DH, DM, w, out_pages, k, base, page_shift):
    """Unmap the ``k`` pages of ``out_pages`` (their chunks already detached); the driver's code
    of the first failure (0: none)."""
    page = 1 << page_shift
    for j in range(k):
        w[W_UNMAP] += 1
        va = base + (out_pages[j] << page_shift)
        code = CD._unmap(DS, DH, DM, va, page)
        if code != CD.OK:
            w[W_ERROR_VA] = va
            return code
    return CD.OK


@njit(cache=True)
def _reclaim(L, S, bases, DS, DH, DM, g, chunk_tag, nmaps, chunk_stack, out_pages, out_chunks, w, page_shift, want):
    """``_reclaim(want)``: pages no live block uses unmapped, the large heap's first, after one
    synchronize; ``(chunks freed, code)``."""
    before = g[H.G_FREE_CHUNKS]
    pages = 0
    for hi in range(2):
        if pages == want:
            break
        if hi == 0:
            _sync(w, chunk_tag)
            k = H.reclaim(L[0], L[12], L[13], nmaps, chunk_stack, g, want - pages, out_pages, out_chunks)
        else:
            k = H.reclaim(S[0], S[12], S[13], nmaps, chunk_stack, g, want - pages, out_pages, out_chunks)
        code = _unmap_pages(DS, DH, DM, w, out_pages, k, bases[hi], page_shift)
        if code != CD.OK:
            return 0, code
        pages += k
    w[W_PAGES_RECLAIMED] += pages
    w[W_RECLAIMS] += 1
    return g[H.G_FREE_CHUNKS] - before, CD.OK


@njit(cache=True)
def map_block(L, S, h, start, n, bases, DS, DH, DR, DM, g, chunk_tag, nmaps, chunk_stack, hnd, out_pages,
              out_chunks, w, page_shift, reclaim_batch):
    """``map_block`` of the block committed at unit ``start`` (``n`` units) of heap ``h`` (0:
    large ``L``, 1: small ``S``): ``MAPPED``; ``NO_ROOM`` (nothing done: the driver's tables
    lack room for ``need`` more handles and mappings; the Python path serves it); ``OOM``: a
    chunk beyond the peak could not be made (``w[W_ERROR]``: the driver's code), the block is
    still committed: the caller frees it and raises, as the Python path does; ``DRIVER_ERROR``:
    a driver call that cannot fail without faults failed (a defect; ``w[W_ERROR]``,
    ``w[W_ERROR_VA]``).

    Runtime complexity: O(pages of the block) plus, on the compiled driver's tables (no Python
    call), the driver work of :meth:`PagedSlowPath.map_block
    <vmstoolkit.pools.paged.slow_path.PagedSlowPath.map_block>`: k maps and one set access per run
    of consecutive pages, a create per chunk made and, for a reclaim, one (counted) synchronize
    and an unmap per page reclaimed."""
    page = 1 << page_shift
    meta = L[0] if h == 0 else S[0]
    page_chunk = L[12] if h == 0 else S[12]
    page_used = L[13] if h == 0 else S[13]
    chunk_live = L[14]
    first, last = H.pages_of(meta, start, n)
    need = 0
    for p in range(first, last):
        if page_chunk[p] == H.NONE:
            need += 1
    if DS[CD.S_NEXT_H] + need >= DH.shape[0] or DS[CD.S_NM] + need > DM.shape[0]:
        return NO_ROOM, need
    # _provide_chunks(need)
    short = need - g[H.G_FREE_CHUNKS]
    if short > 0:
        cap = max(g[H.G_PEAK_LIVE_PAGES], g[H.G_LIVE_PAGES]) + g[H.G_SLACK]
        within = min(short, max(0, cap - g[H.G_TOTAL_CHUNKS]))
        made, code = _create(DS, DH, g, chunk_tag, chunk_stack, hnd, w, page, within)
        if code != CD.OK and code != CD.E_OOM:
            w[W_ERROR] = code
            return DRIVER_ERROR, need
        w[W_CHUNKS_CREATED] += made
        short -= made
        if short > 0:
            got, code = _reclaim(L, S, bases, DS, DH, DM, g, chunk_tag, nmaps, chunk_stack, out_pages, out_chunks,
                                 w, page_shift, max(short, reclaim_batch))
            if code != CD.OK:
                w[W_ERROR] = code
                return DRIVER_ERROR, need
            short -= got
        if short > 0:  # a new peak
            made, code = _create(DS, DH, g, chunk_tag, chunk_stack, hnd, w, page, short)
            if code != CD.OK:
                H.settle_stack(nmaps, chunk_stack, g)
                w[W_ERROR] = code
                return (OOM if code == CD.E_OOM else DRIVER_ERROR), need  # made: not counted, as in Python
            w[W_CHUNKS_CREATED] += made
    k = H.assign_chunks(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, first, last, out_pages,
                        out_chunks)
    if k != need:
        w[W_ERROR] = -1
        return DRIVER_ERROR, need
    # _map_pages(k): one map per page, one set_access per run of consecutive pages
    base = bases[h]
    for j in range(k):
        w[W_MAP] += 1
        va = base + (out_pages[j] << page_shift)
        code = CD._map(DS, DH, DR, DM, va, page, hnd[out_chunks[j]], 0)
        if code != CD.OK:
            w[W_ERROR], w[W_ERROR_VA] = code, va
            return DRIVER_ERROR, need
    i = 0
    while i < k:
        j = i
        while j + 1 < k and out_pages[j + 1] == out_pages[j] + 1:
            j += 1
        w[W_ACCESS] += 1
        va = base + (out_pages[i] << page_shift)
        code = CD._set_access(DS, DM, va, (j - i + 1) * page)
        if code != CD.OK:
            w[W_ERROR], w[W_ERROR_VA] = code, va
            return DRIVER_ERROR, need
        i = j + 1
    H.settle_stack(nmaps, chunk_stack, g)
    w[W_MAPPED] += 1
    w[W_PAGES_MAPPED] += k
    return MAPPED, need


ROOM = 256  # handles and mappings made room for before each compiled call (a block needing more goes to Python)


class CompiledDriverWork:
    """The Python half for the replay of allocator ``a``: whether the next compiled call may map
    (:meth:`before`), and the hand-back of what it did (:meth:`after`)."""

    def __init__(self, a) -> None:
        self.a = a
        # exactly that driver: a subclass (a test's spy) may override the calls bypassed here
        self.eligible = type(a.driver) is CD.CompiledSimulatedDriver and not a.aliases
        self.hnd = np.zeros(a.nmaps.shape[0] if self.eligible else 0, np.int64)  # chunk id -> handle
        self.w = np.zeros(W_SIZE, np.int64)
        self.known = 0  # a.handles[:known] are in hnd
        self.stale = False  # a.handles changed in place (spare ids reused): copy it whole
        self.active = False
        self.none = (np.zeros(CD.S_NS, np.int64), np.zeros((1, 3), np.int64), np.zeros((1, 2), np.int64),
                     np.zeros((1, 5), np.int64))

    def before(self) -> tuple:
        """``(drv, DS, DH, DR, DM)`` for the next ``run_events`` call (``drv`` 0: the Python path maps).
        Runtime complexity: O(chunks made since the last call), O(chunks) when the handle table is
        copied whole, plus a driver table's copy when it grows (``compiled_tables``)."""
        a = self.a
        self.w[:] = 0
        self.w[W_PHYS] = a.driver.physical_bytes
        self.active = False
        if not self.eligible:
            return (0, *self.none)
        if a._spare_ids:
            self.stale = True
            return (0, *self.none)
        tables = a.driver.compiled_tables(ROOM, ROOM)
        if tables is None:
            return (0, *self.none)
        k = len(a.handles)
        if self.stale or k < self.known:
            self.hnd[:k] = a.handles
            self.stale = False
        elif k > self.known:
            self.hnd[self.known:k] = a.handles[self.known:k]
        self.known = k
        self.w[W_NEXT_ID] = k
        self.active = True
        return (1, *tables)

    def after(self) -> tuple[int, int]:
        """Hand the driver calls and counts of the last compiled call back to the driver and the
        allocator; the driver error it stopped on, ``(code, address)`` (code 0: none). Runtime
        complexity: O(chunks the compiled call made); no driver call."""
        if not self.active:
            return 0, 0
        a, w = self.a, self.w
        new = self.hnd[self.known:w[W_NEXT_ID]].tolist()
        a.handles.extend(new)
        self.known += len(new)
        a.driver.account_compiled({"create": int(w[W_CREATE]), "map": int(w[W_MAP]), "unmap": int(w[W_UNMAP]),
                                   "set_access": int(w[W_ACCESS])}, new, a.page, int(w[W_SYNCS]))
        c = a.counts
        c["chunks_created"] += int(w[W_CHUNKS_CREATED])
        c["mapped"] += int(w[W_MAPPED])
        c["pages_mapped"] += int(w[W_PAGES_MAPPED])
        c["pages_reclaimed"] += int(w[W_PAGES_RECLAIMED])
        c["reclaims"] += int(w[W_RECLAIMS])
        self.active = False
        return int(w[W_ERROR]), int(w[W_ERROR_VA])
