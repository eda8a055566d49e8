"""The compiled core of the ``paged`` allocator: a best-fit heap over one virtual range whose
2 MiB pages are backed by physical chunks only where live blocks need them.

Everything here is a Numba ``njit`` function over plain arrays, so that the same code serves
the trace replays (called from Python, :mod:`vmstoolkit.pools.paged.allocator`) and PyTorch's
allocation hook (called from a Numba ``cfunc``, :mod:`vmstoolkit.integrations.native_torch`),
where no Python runs unless the driver has work to do.

A heap counts in *units* (``1 << unit_shift`` bytes; 512 B for the small heap, 2 MiB for the
large one) and in *pages* (2 MiB, the mapping granularity; ``q`` units each). Blocks tile the
range in address order (``b_prev``/``b_next``), free blocks sit in exact-size buckets (one list
per length below ``NB`` units, one overflow list above) found with a bitmap, and a freed block
merges with its free neighbours at once. Per page: the chunk mapped there (``-1``: none) and how
many units of live blocks it holds. Allocation never calls the driver: it commits the block and
reports how many of its pages have no chunk; the caller maps them (:func:`assign_chunks`).
With mapped placement (``meta[M_PLACE_MAPPED]``, whole-page units) a best fit that would need
chunks gives way to the lowest window of free pages that all have theirs
(:func:`_place_mapped`): pages keep their chunks from one shape of batch to the next, and the
driver is called far less for the same peak.
"""

from __future__ import annotations

import numpy as np
from vmstoolkit._jit import njit

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.constants import PAGED_MIN_BLOCKS as MIN_BLOCKS, SMALL_SIZE  # noqa: F401 - read here by the allocator

# meta[] slots of a heap
M_UNITS, M_Q, M_NB, M_REC_TOP, M_TOP, M_LIVE_UNITS, M_CLOCK_ORDER, M_CLOCK, M_PLACE_MAPPED = 0, 1, 2, 3, 4, 5, 6, 7, 8
M_SCANS, M_SCANNED = 9, 10  # mapped placement's searches, and the blocks they visited
M_LOW = 11  # the start of a block with no free block below it (where those searches begin)
# g[] slots shared by the heaps of one device
G_FREE_CHUNKS, G_TOTAL_CHUNKS, G_LIVE_PAGES, G_PEAK_LIVE_PAGES, G_BUSY, G_SLACK = 0, 1, 2, 3, 4, 5
# The allocator's layout constants (pools/paged/allocator.py and the compiled replay read them here).
# SMALL_SIZE (requests of at most 1 MiB go to the small heap) and MIN_BLOCKS (fewest block records
# to start with; the heaps double them when they run out) come from pools/constants.py.
SMALL_UNIT_SHIFT = 9  # 512 B, PyTorch's rounding
MAX_SLOTS = 63  # streams with a bit in chunk tags (int64; the last bit is shared by any further streams)
OVERFLOW_BIT = 1 << (MAX_SLOTS - 1)
G_NSLOTS = 13  # g[] slot: streams with a slot (heap.py uses 0-5, the PyTorch hook 6-12 and 14)
NONE = -1
NO_RECORD = -2  # heap_alloc's start when no block record is left (grow them: Heap.grow_records)


class Heap:
    """The arrays of one heap (see the module docstring); ``units`` of ``1 << unit_shift`` bytes."""

    def __init__(self, units: int, unit_shift: int, page_shift: int, buckets: int, max_blocks: int,
                 chunk_live: np.ndarray, chunk_tag: np.ndarray) -> None:
        q = 1 << (page_shift - unit_shift)
        if units % q:
            raise ConfigError(f"a heap of {units} units does not hold whole pages of {q} units")
        self.unit_shift = unit_shift
        self.meta = np.zeros(12, np.int64)
        self.meta[M_UNITS], self.meta[M_Q], self.meta[M_NB] = units, q, buckets
        self.b_start = np.zeros(max_blocks, np.int64)
        self.b_len = np.zeros(max_blocks, np.int64)
        self.b_free = np.zeros(max_blocks, np.int8)
        self.b_prev = np.full(max_blocks, NONE, np.int32)
        self.b_next = np.full(max_blocks, NONE, np.int32)
        self.b_fprev = np.full(max_blocks, NONE, np.int32)
        self.b_fnext = np.full(max_blocks, NONE, np.int32)
        self.rec_stack = np.arange(max_blocks - 1, -1, -1, dtype=np.int32)  # free block records
        self.block_at = np.full(units, NONE, np.int32)  # block starting at a unit
        self.bucket_head = np.full(buckets + 1, NONE, np.int32)
        self.bits = np.zeros((buckets + 1 + 63) // 64, np.uint64)
        self.page_chunk = np.full(units // q, NONE, np.int32)
        self.page_used = np.zeros(units // q, np.int32)
        self.chunk_live = chunk_live  # per chunk: live pages mapping it (shared by a device's heaps)
        self.b_rec = np.zeros(max_blocks, np.int64)  # per live block: streams recorded on it (slot bits)
        self.chunk_tag = chunk_tag  # per chunk: streams whose queued work may use it (slot bits, shared)
        self.meta[M_REC_TOP] = max_blocks
        init_heap(*self.arrays())

    def arrays(self) -> tuple:
        """The heap's arrays in the order every compiled function takes them. Runtime complexity: O(1)."""
        return (self.meta, self.b_start, self.b_len, self.b_free, self.b_prev, self.b_next, self.b_fprev,
                self.b_fnext, self.rec_stack, self.block_at, self.bucket_head, self.bits, self.page_chunk,
                self.page_used, self.chunk_live, self.b_rec, self.chunk_tag)

    def grow_records(self) -> None:
        """Twice the block records (the compiled code ran out): the block arrays are copied into
        arrays twice as long and the new records pushed on the stack. Callers republish the
        arrays' addresses (the PyTorch hook's table). Runtime complexity: O(records), amortized
        O(1) per block."""
        old = self.b_start.shape[0]
        for name, fill in (("b_start", 0), ("b_len", 0), ("b_free", 0), ("b_prev", NONE), ("b_next", NONE),
                           ("b_fprev", NONE), ("b_fnext", NONE), ("b_rec", 0)):
            a = getattr(self, name)
            b = np.full(2 * old, fill, a.dtype)
            b[:old] = a
            setattr(self, name, b)
        top = int(self.meta[M_REC_TOP])
        stack = np.zeros(2 * old, np.int32)
        stack[:old] = np.arange(2 * old - 1, old - 1, -1, dtype=np.int32)  # new records, taken last
        stack[old:old + top] = self.rec_stack[:top]
        self.rec_stack = stack
        self.meta[M_REC_TOP] = top + old


# The small helpers of heap_alloc and heap_free are inlined (inline='always', Numba's IR inlining):
# as calls, each took and dropped a reference to every array it was passed, an atomic increment and
# decrement each (replay.py's run_events has the figures).
@njit(cache=True, inline='always')
def _bucket(meta, length):
    nb = meta[M_NB]
    return length if length < nb else nb


@njit(cache=True, inline='always')
def _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk):
    k = _bucket(meta, b_len[blk])
    head = bucket_head[k]
    b_fprev[blk] = NONE
    b_fnext[blk] = head
    if head != NONE:
        b_fprev[head] = blk
    bucket_head[k] = blk
    bits[k >> 6] |= np.uint64(1) << np.uint64(k & 63)


@njit(cache=True, inline='always')
def _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk):
    k = _bucket(meta, b_len[blk])
    p, n = b_fprev[blk], b_fnext[blk]
    if p != NONE:
        b_fnext[p] = n
    else:
        bucket_head[k] = n
    if n != NONE:
        b_fprev[n] = p
    if bucket_head[k] == NONE:
        bits[k >> 6] &= ~(np.uint64(1) << np.uint64(k & 63))
    b_fprev[blk] = NONE
    b_fnext[blk] = NONE


@njit(cache=True)
def _new_record(meta, rec_stack):
    top = meta[M_REC_TOP]
    if top == 0:
        return NONE
    meta[M_REC_TOP] = top - 1
    return rec_stack[top - 1]


@njit(cache=True)
def _drop_record(meta, rec_stack, blk):
    rec_stack[meta[M_REC_TOP]] = blk
    meta[M_REC_TOP] += 1


@njit(cache=True, inline='always')
def _split(meta, b_start, b_len, b_free, b_prev, b_next, rec_stack, block_at, blk, k):
    """Cut block ``blk`` (off the free lists) after its first ``k`` units: returns the new free
    block of the rest, linked after it, or ``NONE`` (nothing changed) when no record is left."""
    rest = _new_record(meta, rec_stack)
    if rest == NONE:
        return NONE
    b_start[rest] = b_start[blk] + k
    b_len[rest] = b_len[blk] - k
    b_free[rest] = 1
    b_prev[rest] = blk
    b_next[rest] = b_next[blk]
    if b_next[blk] != NONE:
        b_prev[b_next[blk]] = rest
    b_next[blk] = rest
    block_at[b_start[rest]] = rest
    b_len[blk] = k
    return rest


@njit(cache=True)
def init_heap(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
              bucket_head, bits, page_chunk, page_used, chunk_live, b_rec, chunk_tag):
    """One free block spanning the whole heap. Runtime complexity: O(1)."""
    blk = _new_record(meta, rec_stack)
    b_start[blk] = 0
    b_len[blk] = meta[M_UNITS]
    b_free[blk] = 1
    b_prev[blk] = NONE
    b_next[blk] = NONE
    block_at[0] = blk
    _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk)


@njit(cache=True, inline='always')
def _find_fit(meta, b_len, b_fnext, bucket_head, bits, n):
    """The free block to serve ``n`` units: the newest of the smallest exact bucket at least
    ``n``, else the smallest fit of the overflow list; ``NONE`` if nothing is that large."""
    nb = meta[M_NB]
    if n < nb:
        w = n >> 6
        word = bits[w] & ~((np.uint64(1) << np.uint64(n & 63)) - np.uint64(1))
        nwords = bits.shape[0]
        while True:
            if word != np.uint64(0):
                k = (w << 6) + _ctz(word)
                return bucket_head[k]
            w += 1
            if w >= nwords:
                return NONE
            word = bits[w]
    best = NONE
    blk = bucket_head[nb]
    while blk != NONE:
        if b_len[blk] >= n and (best == NONE or b_len[blk] < b_len[best]):
            best = blk
        blk = b_fnext[blk]
    return best


@njit(cache=True)
def _ctz(word):
    k = 0
    while (word & np.uint64(1)) == np.uint64(0):
        word >>= np.uint64(1)
        k += 1
    return k


@njit(cache=True)
def heap_alloc(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
               bucket_head, bits, page_chunk, page_used, chunk_live, b_rec, chunk_tag, g, n):
    """Commit a block of ``n`` units. Returns ``(start unit, pages without a chunk)``,
    ``(-1, 0)`` when no free block is large enough, or ``(NO_RECORD, 0)`` when no block record
    is left (nothing changed either way).

    Runtime complexity: O(pages of the block) plus the fit: a scan of the bucket bitmap's words
    above ``n`` (``NB / 64`` at most) below ``NB`` units, the overflow list's length at or above
    it; with mapped placement, when the fit lacks chunks, a walk of the blocks below the mapped
    top sliding a window over each free one (:func:`_place_mapped`)."""
    blk = _find_fit(meta, b_len, b_fnext, bucket_head, bits, n)
    if blk == NONE:
        return -1, 0
    if meta[M_PLACE_MAPPED] == 1 and meta[M_Q] == 1 and _missing(page_chunk, chunk_live, b_start[blk], n) > 0:
        blk = _place_mapped(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
                            bucket_head, bits, page_chunk, chunk_live, blk, n)
    if b_len[blk] > n:
        _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk)
        rest = _split(meta, b_start, b_len, b_free, b_prev, b_next, rec_stack, block_at, blk, n)
        if rest == NONE:
            _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk)
            return NO_RECORD, 0
        _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, rest)
    else:
        _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk)
    b_free[blk] = 0
    b_rec[blk] = 0
    start = b_start[blk]
    meta[M_LIVE_UNITS] += n
    q = meta[M_Q]
    missing = 0
    u = start
    end = start + n
    while u < end:
        p = u // q
        nxt = min(end, (p + 1) * q)
        c = page_chunk[p]
        if page_used[p] == 0:
            g[G_LIVE_PAGES] += 1
            if c != NONE:
                chunk_live[c] += 1
                if chunk_live[c] > 1:  # its chunk is live through another mapping: remapped by the caller
                    missing += 1
        page_used[p] += nxt - u
        if c == NONE:
            missing += 1
        u = nxt
    if g[G_LIVE_PAGES] > g[G_PEAK_LIVE_PAGES]:
        g[G_PEAK_LIVE_PAGES] = g[G_LIVE_PAGES]
    return start, missing


CONFLICT_COST = 4  # a page whose chunk is live elsewhere: a synchronize and an unmap before the map


@njit(cache=True, inline='always')
def _cost(page_chunk, chunk_live, p):
    """Driver work to make page ``p`` usable by a new block: 0 when its chunk is idle, 1 when it
    has none (map one), ``CONFLICT_COST`` when its chunk is live through another mapping."""
    c = page_chunk[p]
    if c == NONE:
        return 1
    return 0 if chunk_live[c] == 0 else CONFLICT_COST


@njit(cache=True, inline='always')
def _missing(page_chunk, chunk_live, first, n):
    """The driver work (:func:`_cost`) the ``n`` pages from ``first`` need (whole-page units)."""
    k = 0
    for p in range(first, first + n):
        k += _cost(page_chunk, chunk_live, p)
    return k


@njit(cache=True)
def _place_mapped(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
                  bucket_head, bits, page_chunk, chunk_live, blk, n):
    """The free block to carve ``n`` pages from when the best fit ``blk`` would need chunks: the
    lowest window of ``n`` pages inside a free block whose pages all have idle chunks, else the
    window needing the least driver work (:func:`_cost`; then the smaller block), split off so
    that it starts a free block. Returns ``blk`` unchanged when no window beats it. Only the mapped part of the
    heap (below ``M_TOP``) is scanned, in address order: microseconds, against the driver calls
    that each missing page costs (whole-page units only)."""
    top = meta[M_TOP]
    meta[M_SCANS] += 1
    best_missing = _missing(page_chunk, chunk_live, b_start[blk], n)
    best, best_at = blk, b_start[blk]
    b = block_at[meta[M_LOW]]
    while b != NONE and b_free[b] == 0:  # the live bottom of the heap (weights, optimizer state)
        b = b_next[b]
    if b != NONE:
        meta[M_LOW] = b_start[b]
    while b != NONE and b_start[b] < top and best_missing > 0:
        if b_free[b] == 1 and b_len[b] >= n:
            s, e = b_start[b], b_start[b] + b_len[b]
            miss = _missing(page_chunk, chunk_live, s, n)
            at = s
            m = miss
            w = s
            while m > 0 and w + n < e and w < top:  # slide the window one page at a time
                m += _cost(page_chunk, chunk_live, w + n) - _cost(page_chunk, chunk_live, w)
                w += 1
                if m < miss:
                    miss, at = m, w
            if miss < best_missing or (miss == best_missing and b_len[b] < b_len[best]):
                best_missing, best, best_at = miss, b, at
        meta[M_SCANNED] += 1
        b = b_next[b]
    if best_at == b_start[best]:
        return best
    _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, best)
    rest = _split(meta, b_start, b_len, b_free, b_prev, b_next, rec_stack, block_at, best, best_at - b_start[best])
    _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, best)  # [start, at) stays free
    if rest == NONE:
        return blk
    _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, rest)
    return rest


@njit(cache=True)
def heap_free(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
              bucket_head, bits, page_chunk, page_used, chunk_live, b_rec, chunk_tag, g, start, sbits):
    """Free the live block at unit ``start``; returns its length, or -1 if none is live there.
    Runtime complexity: O(pages of the block); merging with both neighbours is O(1).
    Its pages keep their chunks (reclaimed only when memory is needed elsewhere); their chunks
    are tagged with ``sbits`` (the streams the block was used on) and the streams recorded on the
    block: a later block on another stream waits for them (:func:`take_tags`)."""
    if start < 0 or start >= meta[M_UNITS]:
        return -1
    blk = block_at[start]
    if blk == NONE or b_free[blk] != 0:
        return -1
    tag = sbits | b_rec[blk]
    b_rec[blk] = 0
    n = b_len[blk]
    q = meta[M_Q]
    u = start
    end = start + n
    while u < end:
        p = u // q
        nxt = min(end, (p + 1) * q)
        page_used[p] -= nxt - u
        if page_chunk[p] != NONE:
            chunk_tag[page_chunk[p]] |= tag
        if page_used[p] == 0:
            g[G_LIVE_PAGES] -= 1
            if page_chunk[p] != NONE:
                chunk_live[page_chunk[p]] -= 1
        u = nxt
    meta[M_LIVE_UNITS] -= n
    b_free[blk] = 1
    prv = b_prev[blk]
    if prv != NONE and b_free[prv] == 1:  # merge into the free block before
        _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, prv)
        b_len[prv] += b_len[blk]
        b_next[prv] = b_next[blk]
        if b_next[blk] != NONE:
            b_prev[b_next[blk]] = prv
        block_at[start] = NONE
        _drop_record(meta, rec_stack, blk)
        blk = prv
    nxt_blk = b_next[blk]
    if nxt_blk != NONE and b_free[nxt_blk] == 1:  # absorb the free block after
        _pop_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, nxt_blk)
        b_len[blk] += b_len[nxt_blk]
        b_next[blk] = b_next[nxt_blk]
        if b_next[nxt_blk] != NONE:
            b_prev[b_next[nxt_blk]] = blk
        block_at[b_start[nxt_blk]] = NONE
        _drop_record(meta, rec_stack, nxt_blk)
    _push_free(meta, b_len, b_fprev, b_fnext, bucket_head, bits, blk)
    if b_start[blk] < meta[M_LOW]:
        meta[M_LOW] = b_start[blk]
    return n


@njit(cache=True)
def take_tags(meta, page_chunk, page_used, chunk_tag, start, n, tbit):
    """The streams (slot bits) whose queued work may still use the chunks of the block just
    committed at units ``[start, start + n)``, other than its own stream ``tbit``: the caller
    orders its stream after them before handing the block out. A page the live blocks now fill
    whole loses its tag (every block on it was ordered so); an overflow stream (``tbit`` 0)
    gets every tag. Runtime complexity: O(pages of the block), one pass."""
    q = meta[M_Q]
    w = 0
    for p in range(start // q, (start + n + q - 1) // q):
        c = page_chunk[p]
        if c != NONE:
            w |= chunk_tag[c] & ~tbit
            if page_used[p] == q:
                chunk_tag[c] = 0
    return w


@njit(cache=True)
def record_on(meta, b_free, block_at, b_rec, start, bits):
    """Add ``bits`` (streams) to the live block at unit ``start``; False if none is live there.
    Runtime complexity: O(1)."""
    if start < 0 or start >= meta[M_UNITS]:
        return False
    blk = block_at[start]
    if blk == NONE or b_free[blk] != 0:
        return False
    b_rec[blk] |= bits
    return True


@njit(cache=True)
def live_starts(b_start, b_free, b_next, block_at):
    """The start units of every live block, in address order. Runtime complexity: O(blocks)."""
    out = []
    b = block_at[0]
    while b != NONE:
        if b_free[b] == 0:
            out.append(b_start[b])
        b = b_next[b]
    return out


@njit(cache=True)
def pages_of(meta, start, n):
    """First and one-past-last page of units ``[start, start + n)``. Runtime complexity: O(1)."""
    q = meta[M_Q]
    return start // q, (start + n + q - 1) // q


@njit(cache=True)
def _detach(page_chunk, nmaps, chunk_stack, g, p, out_pages, out_chunks, got):
    """Take page ``p``'s chunk off it (the caller unmaps it); the chunk goes onto the stack once
    no page maps it. Records the page and chunk at ``got``."""
    c = page_chunk[p]
    page_chunk[p] = NONE
    nmaps[c] -= 1
    if nmaps[c] == 0:
        chunk_stack[g[G_FREE_CHUNKS]] = c
        g[G_FREE_CHUNKS] += 1
    out_pages[got] = p
    out_chunks[got] = c


@njit(cache=True)
def reattach(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, pages, chunks, i, k):
    """Undo :func:`_detach` for entries ``k-1`` down to ``i`` (their unmapping failed).
    Runtime complexity: O(k - i)."""
    for j in range(k - 1, i - 1, -1):
        p, c = pages[j], chunks[j]
        if nmaps[c] == 0:  # pushed when this page let it go: the top of the stack
            g[G_FREE_CHUNKS] -= 1
        nmaps[c] += 1
        if page_used[p] > 0:
            chunk_live[c] += 1
        page_chunk[p] = c
        if p + 1 > meta[M_TOP]:
            meta[M_TOP] = p + 1


@njit(cache=True)
def reclaim(meta, page_chunk, page_used, nmaps, chunk_stack, g, want, out_pages, out_chunks):
    """Take the chunks off up to ``want`` pages that no live block uses; returns how many pages,
    listed in ``out_pages``/``out_chunks`` (the caller unmaps them). A chunk goes onto
    ``chunk_stack`` when its last page lets it go.

    Highest address first: best fit fills the low end of the heap, so the high pages are the
    ones least likely to be needed again soon. ``meta[M_CLOCK_ORDER] = 1`` sweeps like a clock
    instead (from where the last sweep stopped), for comparison: on the traces it remapped
    1.4-9.9x more in steady state under best-fit placement, up to 1.3x more under mapped
    placement, which avoids most reclaims (``docs/results.md#paged-policy``).

    Runtime complexity: O(pages below the mapped top) at worst (the pages passed over while
    looking for ``want`` idle ones)."""
    got = 0
    npages = page_chunk.shape[0]
    if meta[M_CLOCK_ORDER] == 1:
        hand = meta[M_CLOCK]
        for _ in range(npages):
            if got == want:
                break
            p = hand
            hand = hand + 1 if hand + 1 < npages else 0
            if page_chunk[p] != NONE and page_used[p] == 0:
                _detach(page_chunk, nmaps, chunk_stack, g, p, out_pages, out_chunks, got)
                got += 1
        meta[M_CLOCK] = hand
        return got
    p = meta[M_TOP] - 1
    while p >= 0 and got < want:
        if page_chunk[p] != NONE and page_used[p] == 0:
            _detach(page_chunk, nmaps, chunk_stack, g, p, out_pages, out_chunks, got)
            got += 1
        p -= 1
    while meta[M_TOP] > 0 and page_chunk[meta[M_TOP] - 1] == NONE:
        meta[M_TOP] -= 1
    return got


@njit(cache=True)
def conflicts(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, start, n, out_pages, out_chunks):
    """Pages of the block just committed at units ``[start, start + n)`` that it made live but
    whose chunk is live through another mapping too: their chunks come off them (the caller
    unmaps them, then gives them others). Returns how many, in ``out_pages``/``out_chunks``.

    Only a page the block made live can be one: a page it shares with a live neighbour (units
    finer than a page) was live before, and keeps its chunk and the neighbour's data, even when
    the other mapping of that chunk is a later page of this same block (that page is remapped).
    Runtime complexity: O(pages of the block)."""
    q = meta[M_Q]
    k = 0
    u = start
    end = start + n
    while u < end:
        p = u // q
        nxt = min(end, (p + 1) * q)
        c = page_chunk[p]
        if c != NONE and page_used[p] == nxt - u and chunk_live[c] > 1:  # all its live units are the block's
            chunk_live[c] -= 1
            _detach(page_chunk, nmaps, chunk_stack, g, p, out_pages, out_chunks, k)
            k += 1
        u = nxt
    return k


def shared_with_live_neighbours(meta, page_chunk, page_used, chunk_live, start: int, n: int) -> list[int]:
    """Diagnostics, on no allocation path: the pages of units ``[start, start + n)`` that a live
    neighbour also holds (more live units than the block's own) and whose chunk is live through
    another mapping too. :func:`conflicts` must leave each such page its chunk (the neighbour's
    data is there) and remap the block's other page instead. Plain Python, O(pages of the window)."""
    q = int(meta[M_Q])
    pages = []
    for p in range(start // q, (start + n + q - 1) // q):
        mine = min(start + n, (p + 1) * q) - max(start, p * q)
        c = page_chunk[p]
        if c != NONE and page_used[p] > mine and chunk_live[c] > 1:
            pages.append(p)
    return pages


@njit(cache=True)
def lend_idle(chunk_live, nmaps, nchunks, chunk_stack, g, hand, want):
    """Push up to ``want`` chunks that are mapped only where no live block is (no page of theirs
    is live) onto the stack, to be mapped once more where they are needed, as aliases: no
    unmapping, so no wait for queued work. Sweeps chunk ids from ``hand[0]``; returns how many.
    Runtime complexity: O(chunks) at worst (one sweep)."""
    got = 0
    h = hand[0]
    for _ in range(nchunks):
        if got == want:
            break
        if nmaps[h] > 0 and chunk_live[h] == 0:  # mapped, so not on the stack already
            chunk_stack[g[G_FREE_CHUNKS]] = h
            g[G_FREE_CHUNKS] += 1
            got += 1
        h = h + 1 if h + 1 < nchunks else 0
    hand[0] = h
    return got


@njit(cache=True)
def settle_stack(nmaps, chunk_stack, g):
    """Drop from the stack the chunks lent by :func:`lend_idle` but not used (they are still
    mapped elsewhere): at rest the stack holds only chunks mapped nowhere. Runtime complexity:
    O(chunks on the stack)."""
    k = 0
    for i in range(g[G_FREE_CHUNKS]):
        c = chunk_stack[i]
        if nmaps[c] == 0:
            chunk_stack[k] = c
            k += 1
    g[G_FREE_CHUNKS] = k


@njit(cache=True)
def assign_chunks(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, first, last, out_pages, out_chunks):
    """Give every page in ``[first, last)`` without a chunk one from ``chunk_stack``; returns
    how many (pages and chunks in ``out_pages``/``out_chunks``), or -1 if the stack runs short
    (then nothing is assigned). Runtime complexity: O(last - first)."""
    need = 0
    for p in range(first, last):
        if page_chunk[p] == NONE:
            need += 1
    if need > g[G_FREE_CHUNKS]:
        return -1
    k = 0
    for p in range(first, last):
        if page_chunk[p] == NONE:
            g[G_FREE_CHUNKS] -= 1
            c = chunk_stack[g[G_FREE_CHUNKS]]
            page_chunk[p] = c
            nmaps[c] += 1
            if page_used[p] > 0:
                chunk_live[c] += 1
            if p + 1 > meta[M_TOP]:
                meta[M_TOP] = p + 1
            out_pages[k] = p
            out_chunks[k] = c
            k += 1
    return k


@njit(cache=True)
def unassign(page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, pages, k):
    """Undo :func:`assign_chunks` for the first ``k`` of ``pages`` (a mapping that failed).
    Runtime complexity: O(k)."""
    for i in range(k - 1, -1, -1):
        p = pages[i]
        c = page_chunk[p]
        nmaps[c] -= 1
        if page_used[p] > 0:
            chunk_live[c] -= 1
        chunk_stack[g[G_FREE_CHUNKS]] = c
        g[G_FREE_CHUNKS] += 1
        page_chunk[p] = NONE


@njit(cache=True)
def check_heap(meta, b_start, b_len, b_free, b_prev, b_next, b_fprev, b_fnext, rec_stack, block_at,
               bucket_head, bits, page_chunk, page_used, chunk_live, b_rec, chunk_tag):
    """0 when every invariant holds, else a code naming the first broken one. Runtime
    complexity: O(units + blocks + buckets) (tests and stress runs only)."""
    units = meta[M_UNITS]
    q = meta[M_Q]
    used = np.zeros(page_used.shape[0], np.int64)
    blk = block_at[0]
    if blk == NONE or b_prev[blk] != NONE:
        return 1  # the first block starts at 0
    pos = 0
    nblocks = 0
    live = 0
    while blk != NONE:
        if b_start[blk] != pos or b_len[blk] <= 0 or block_at[pos] != blk:
            return 2  # blocks tile the range in order
        nxt = b_next[blk]
        if nxt != NONE and b_prev[nxt] != blk:
            return 3  # address links agree
        if b_free[blk] == 1 and nxt != NONE and b_free[nxt] == 1:
            return 4  # no two free neighbours
        if b_free[blk] == 0:
            live += b_len[blk]
            u = pos
            end = pos + b_len[blk]
            while u < end:
                p = u // q
                nu = min(end, (p + 1) * q)
                used[p] += nu - u
                u = nu
        pos += b_len[blk]
        nblocks += 1
        blk = nxt
    if pos != units:
        return 5  # the blocks cover the heap
    if live != meta[M_LIVE_UNITS]:
        return 6
    for p in range(page_used.shape[0]):
        if used[p] != page_used[p]:
            return 7  # per-page live units
    nfree_listed = 0
    for k in range(bucket_head.shape[0]):
        b = bucket_head[k]
        has = (bits[k >> 6] >> np.uint64(k & 63)) & np.uint64(1)
        if (b != NONE) != (has == np.uint64(1)):
            return 8  # bitmap agrees with the lists
        while b != NONE:
            if b_free[b] != 1 or _bucket(meta, b_len[b]) != k:
                return 9  # a listed block is free and in its bucket
            nfree_listed += 1
            b = b_fnext[b]
    nfree = 0
    blk = block_at[0]
    while blk != NONE:
        nfree += b_free[blk]
        blk = b_next[blk]
    if nfree != nfree_listed:
        return 10  # every free block is listed once
    if meta[M_REC_TOP] + nblocks != rec_stack.shape[0]:
        return 11  # block records are in use or on the stack
    low = block_at[meta[M_LOW]]
    if low == NONE:
        return 12  # the search start is a block's start
    blk = block_at[0]
    while blk != low:
        if b_free[blk] == 1:
            return 13  # no free block below the search start
        blk = b_next[blk]
    return 0
