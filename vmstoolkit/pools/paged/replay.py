"""Compiled replay of a trace through ``paged``: the heap runs in one ``njit`` loop, and on the
compiled simulated driver the pages' mapping too; Python for the rest of the driver's work.

:func:`run_events` walks the events (each free's block found beforehand by :func:`match_frees`),
commits and frees blocks with the compiled heap (:mod:`~vmstoolkit.pools.paged.heap`) and keeps
the :class:`~vmstoolkit.pools.base.Allocator` counters (allocated bytes, peaks, totals). On the
compiled simulated driver (and without ``aliases``, planned faults or queued work) a block whose
pages lack chunks is mapped in the loop (:mod:`~vmstoolkit.pools.paged.driver_work`: the steps
of ``map_block`` on the driver's tables). It returns to Python at the first event that needs more:

- ``PLACE``: the heap cannot place it as is (ranges not yet reserved, block records or virtual
  range exhausted, a failed rollback to repair): nothing is changed and
  :meth:`PagedAllocator.alloc_block` serves the whole request;
- ``FINISH``: the block is committed but some of its pages lack chunks (another driver, or no
  room in the driver's tables), its stream has no slot yet, or another stream's work may still
  use them: :meth:`PagedAllocator.finish_block` maps and orders, as it does for every Python
  allocation;
- ``ORDER``: mapped in the loop, but other streams' work may still use its chunks:
  :meth:`PagedAllocator.wait_for` orders the stream after it;
- ``MAP_FAILED``: the loop's mapping ran out of memory: the block is freed and the error
  raised, as ``map_block`` does (:meth:`PagedAllocator.mapping_failed`);
- ``SLOT``: a free on a stream without a slot yet: :meth:`PagedAllocator.slot_bit` gives it one;
- ``FULL``: a size no allocator can serve: :meth:`Allocator.allocate` raises its error.

Then the loop resumes at that event with its address. The decisions are therefore the ones the
Python replay makes (the same compiled heap, the same driver steps, in the same order),
so the results are the same to the byte: ``tests/pools/paged/test_paged_replay.py`` checks it on every
bundled trace, and the driver's state after it. Cost: 0.6-0.8 µs per event in the loop, about
5 µs per return to Python; a generated 500k-entry snapshot replays in 0.67 s of CPU
(``benchmarks/replay_speed.py --generated``), where each block that needed pages was a return
to Python and a Python call per driver call (0.9-1.0 s).
"""

from __future__ import annotations

import time

import numpy as np
from vmstoolkit._jit import njit

from vmstoolkit.errors import OutOfMemoryError
from vmstoolkit.pools.base import CompiledReplay, ReplayArrays
from vmstoolkit.pools.drivers import compiled as CD
from vmstoolkit.pools.paged import driver_work as DW
from vmstoolkit.pools.paged import heap as H

# st[] slots: the base class's counters while the loop runs (written back at the end), and the
# replay's own
S_ALLOCATED, S_PEAK, S_COUNT, S_PEAK_COUNT, S_ALLOCS, S_FREES, S_BYTES = 0, 1, 2, 3, 4, 5, 6
S_FAST, S_UNMATCHED, S_HOME, S_HAS_HOME = 7, 8, 9, 10
# why run_events returned
DONE, FULL, PLACE, FINISH, SLOT, DOUBLE, ORDER, MAP_FAILED = 0, 1, 2, 3, 4, 5, 6, 7
UNMATCHED = -1  # match[]: a free of memory allocated before recording; >= 0: the record it frees;
# <= -2: a double free (the address was freed at event -v - 2 already)


@njit(cache=True)
def _slot_bit(slot_keys, slot_bits, nslots, stream):
    for k in range(nslots):
        if slot_keys[k] == stream:
            return slot_bits[k]
    return 0


@njit(cache=True)
def _waiting(meta, page_chunk, chunk_tag, start, n, tbit):
    """The tags :func:`~heap.take_tags` would return, read only (non-zero: the Python step orders)."""
    q = meta[H.M_Q]
    w = 0
    for p in range(start // q, (start + n + q - 1) // q):
        c = page_chunk[p]
        if c != H.NONE:
            w |= chunk_tag[c] & ~tbit
    return w


def match_frees(is_alloc: np.ndarray, addr: np.ndarray, pre_addr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each free does, as the Python replay's address map decides it, computed for all
    events at once: ``match`` (see ``UNMATCHED``; records are the pre-existing blocks, then the
    events) and ``pre_first``: the first free of a pre-existing block's address, which the
    Python replay counts as unmatched too. Cost: one stable sort of the addresses.

    Per address, in time order, a free frees the latest allocation when no free came between;
    after such a free, another one is a double free; with no allocation before, it is unmatched."""
    npre, n = len(pre_addr), len(addr)
    total = npre + n
    keys = np.concatenate([pre_addr, addr]).astype(np.int64)
    alloc = np.concatenate([np.ones(npre, bool), is_alloc.astype(bool)])
    order = np.argsort(keys, kind="stable")  # by address, then time
    k, a = keys[order], alloc[order]
    new_group = np.ones(total, bool)
    new_group[1:] = k[1:] != k[:-1]
    gid = np.cumsum(new_group) - 1
    # sorted position of the latest allocation so far in the group (-1: none)
    idx = np.arange(total)
    last = np.maximum.accumulate(np.where(a, gid * (total + 1) + idx + 1, gid * (total + 1))) - gid * (total + 1) - 1
    frees = np.cumsum(~a)
    between = frees - frees[np.maximum(last, 0)]  # frees since that allocation, this one included
    m = np.full(total, UNMATCHED, np.int64)
    matched = ~a & (last >= 0) & (between == 1)
    m[matched] = order[last[matched]]
    double = ~a & (last >= 0) & (between > 1)
    m[double] = -2 - (order[last[double] + 1] - npre)  # the free right after the allocation
    match = np.empty(total, np.int64)
    match[order] = m
    pre_first = np.zeros(n, np.int8)
    if npre:
        cand = np.flatnonzero(matched & np.isin(k, pre_addr))
        if len(cand):
            _, first = np.unique(gid[cand], return_index=True)
            pre_first[order[cand[first]] - npre] = 1
    return match[npre:], pre_first


@njit(cache=True)
def run_events(is_alloc, size, stream, match, pre_first, rec_ptr, rec_size, rec_stream, rec_live, rec_freed, npre,
               i, end, resume_ptr, L, S, g, chunk_tag, st, slot_keys, slot_bits, nslots, bases,
               shifts, capacity, small_size, overflow_bit, timeline, tl_alloc, tl_res, out,
               drv, DS, DH, DR, DM, nmaps, chunk_stack, hnd, out_pages, out_chunks, w, page_shift, reclaim_batch):
    """Replay events ``i`` to ``end`` (see the module docstring); ``resume_ptr`` >= 0 is event
    ``i``'s address, served by Python. ``bases``: (large, small) range starts (-1: not reserved)
    and sizes; ``shifts``: their unit shifts. Returns ``(why, event)``; ``out`` holds the heap
    (1: small), start unit and missing pages of a ``FINISH``, the earlier free of a ``DOUBLE``,
    the heap, start unit and streams to wait for of an ``ORDER``, the heap, start unit and
    pages needed of a ``MAP_FAILED``. With ``drv`` 1, blocks that need pages are mapped here
    (:func:`~vmstoolkit.pools.paged.driver_work.map_block`, on the driver's tables ``DS``,
    ``DH``, ``DR``, ``DM``); ``w[W_PHYS]``: the physical bytes for the timeline.

    Runtime complexity: O(pages of each block + the fit) per event (the heap's ``heap_alloc`` and
    ``heap_free``), compiled, plus the driver work of the blocks mapped here; no Python call."""
    # The heaps' arrays are unpacked once, here, and passed one by one: unpacking ``*L`` at each
    # call made Numba take and drop a reference to each of the 17 arrays, an atomic increment
    # and decrement each, for every event (40% of the loop's time on a generated 500k-event
    # snapshot); the heap's small helpers are inlined for the same reason (heap.py).
    (l0, l1, l2, l3, l4, l5, l6, l7, l8,
     l9, l10, l11, l12, l13, l14, l15, l16) = L
    (s0, s1, s2, s3, s4, s5, s6, s7, s8,
     s9, s10, s11, s12, s13, s14, s15, s16) = S
    while i < end:
        if is_alloc[i]:
            if resume_ptr >= 0:
                ptr = resume_ptr
                resume_ptr = -1
            else:
                sz = size[i]
                if sz <= 0 or sz > capacity:
                    return FULL, i
                if st[S_HAS_HOME] == 0:  # the base class's first stream
                    st[S_HOME] = stream[i]
                    st[S_HAS_HOME] = 1
                if bases[0] < 0 or g[H.G_BUSY] != 0 or sz > bases[2]:
                    return PLACE, i
                h = 0
                start = -1
                missing = 0
                if sz <= small_size:
                    n = (sz + (1 << shifts[1]) - 1) >> shifts[1]
                    start, missing = H.heap_alloc(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14,
                                                  s15, s16, g, n)
                    if start == H.NO_RECORD:
                        return PLACE, i
                    h = 1
                if start < 0:
                    n = (sz + (1 << shifts[0]) - 1) >> shifts[0]
                    start, missing = H.heap_alloc(l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14,
                                              l15, l16, g, n)
                    h = 0
                    if start < 0:  # NO_RECORD or full: nothing changed, Python grows or raises
                        return PLACE, i
                out[0] = h
                out[1] = start
                out[2] = missing
                bit = _slot_bit(slot_keys, slot_bits, nslots, stream[i])
                if bit == 0 or (missing > 0 and drv == 0):
                    return FINISH, i
                mine = 0 if bit == overflow_bit else bit
                if missing > 0:  # finish_block's map_block, then its order_after
                    r, need = DW.map_block(L, S, h, start, n, bases, DS, DH, DR, DM, g, chunk_tag, nmaps,
                                           chunk_stack, hnd, out_pages, out_chunks, w, page_shift, reclaim_batch)
                    if r == DW.NO_ROOM:
                        return FINISH, i
                    if r != DW.MAPPED:
                        out[2] = need
                        return MAP_FAILED, i
                    if h == 1:
                        tw = H.take_tags(s0, s12, s13, chunk_tag, start, n, mine)
                    else:
                        tw = H.take_tags(l0, l12, l13, chunk_tag, start, n, mine)
                    if tw != 0:
                        out[2] = tw
                        return ORDER, i
                else:
                    if h == 1:
                        if _waiting(s0, s12, chunk_tag, start, n, mine) != 0:
                            return FINISH, i
                        H.take_tags(s0, s12, s13, chunk_tag, start, n, mine)
                    else:
                        if _waiting(l0, l12, chunk_tag, start, n, mine) != 0:
                            return FINISH, i
                        H.take_tags(l0, l12, l13, chunk_tag, start, n, mine)
                    st[S_FAST] += 1
                ptr = bases[h] + (start << shifts[h])
            r = npre + i
            rec_ptr[r] = ptr
            rec_live[r] = 1
            st[S_ALLOCATED] += size[i]
            st[S_ALLOCS] += 1
            st[S_BYTES] += size[i]
            st[S_COUNT] += 1
            if st[S_ALLOCATED] > st[S_PEAK]:
                st[S_PEAK] = st[S_ALLOCATED]
            if st[S_COUNT] > st[S_PEAK_COUNT]:
                st[S_PEAK_COUNT] = st[S_COUNT]
        else:
            v = match[i]
            if v >= 0:
                own = _slot_bit(slot_keys, slot_bits, nslots, rec_stream[v])
                other = _slot_bit(slot_keys, slot_bits, nslots, stream[i])
                if own == 0 or other == 0:
                    return SLOT, i
                ptr = rec_ptr[v]
                if bases[0] <= ptr < bases[0] + bases[2]:
                    freed = H.heap_free(l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15, l16,
                                        g, (ptr - bases[0]) >> shifts[0], own | other)
                else:
                    freed = H.heap_free(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, s16,
                                        g, (ptr - bases[1]) >> shifts[1], own | other)
                assert freed > 0
                rec_live[v] = 0
                rec_freed[v] = i
                st[S_ALLOCATED] -= rec_size[v]
                st[S_FREES] += 1
                st[S_COUNT] -= 1
                if pre_first[i]:
                    st[S_UNMATCHED] += 1  # allocated before recording began, made at the start
            elif v == UNMATCHED:
                st[S_UNMATCHED] += 1  # allocated before recording began
            else:
                out[0] = -v - 2
                return DOUBLE, i
        if timeline:
            tl_alloc[i] = st[S_ALLOCATED]
            tl_res[i] = w[DW.W_PHYS]
        i += 1
    return DONE, i


def replay_paged(a, ev: ReplayArrays) -> CompiledReplay:
    """Replay ``ev`` through the ``paged`` allocator ``a`` (its ``compiled_replay``), holding its
    slow-path lock throughout (the heap changes outside its methods). Runtime complexity: O(E
    log(E)) for E events (matching frees: one sort), then :func:`run_events`' per event, plus a
    return to Python, with its driver calls, for each event the compiled loop cannot serve."""
    with a.slow_lock:
        return _replay(a, ev)


def _replay(a, ev: ReplayArrays) -> CompiledReplay:
    OVERFLOW_BIT, SMALL_SIZE = H.OVERFLOW_BIT, H.SMALL_SIZE

    n = len(ev.is_alloc)
    npre = len(ev.pre_addr)
    rec_ptr = np.zeros(npre + n, np.int64)
    rec_ptr[:npre] = ev.pre_ptr
    rec_size = np.concatenate([ev.pre_size, ev.size]).astype(np.int64)
    rec_stream = np.concatenate([ev.pre_stream, ev.stream]).astype(np.int64)
    rec_live = np.zeros(npre + n, np.int8)
    rec_live[:npre] = 1
    rec_freed = np.full(npre + n, -1, np.int64)
    match, pre_first = match_frees(ev.is_alloc, ev.addr, ev.pre_addr)
    home = a.stream_home()
    st = np.zeros(S_HAS_HOME + 1, np.int64)
    st[:S_FAST] = a.export_counters()  # the base class's counters, laid out as Allocator.COUNTERS
    st[S_HOME], st[S_HAS_HOME] = home or 0, home is not None
    tl_alloc = np.zeros(n if ev.timeline else 0, np.int64)
    tl_res = np.zeros(n if ev.timeline else 0, np.int64)
    out = np.zeros(3, np.int64)
    shifts = np.array([a.large.unit_shift, a.small.unit_shift], np.int64)
    every = ev.progress_every if ev.progress is not None else 0
    result = CompiledReplay(done=0)
    i, resume, nslots = 0, -1, -1
    work = DW.CompiledDriverWork(a)
    page_shift, reclaim_batch = a.page_shift, a.reclaim_batch
    try:
        while True:
            if nslots != len(a._slot):  # streams got slots in the Python step
                nslots = len(a._slot)
                keys = np.array(list(a._slot), np.int64)
                bits = np.array([1 << s for s in a._slot.values()], np.int64)
            bases = np.array([-1 if a.large.base is None else a.large.base, -1 if a.small.base is None else a.small.base,
                              a.large.nbytes, a.small.nbytes], np.int64)
            end = min(n, (i // every + 1) * every) if every else n
            drv, DS, DH, DR, DM = work.before()
            t0 = time.perf_counter()
            try:
                why, i = run_events(ev.is_alloc, ev.size, ev.stream, match, pre_first, rec_ptr, rec_size, rec_stream,
                                    rec_live, rec_freed, npre, i, end, resume, a.large.arrays(), a.small.arrays(),
                                    a.g, a.chunk_tag, st, keys, bits, nslots, bases, shifts, a.driver.capacity,
                                    SMALL_SIZE, OVERFLOW_BIT, ev.timeline, tl_alloc, tl_res, out, drv, DS, DH, DR,
                                    DM, a.nmaps, a.chunk_stack, work.hnd, a._out_pages, a._out_chunks, work.w,
                                    page_shift, reclaim_batch)
            finally:
                result.loop_seconds += time.perf_counter() - t0
                code, va = work.after()  # the driver and the allocator take on the compiled driver work
            resume = -1
            if why == DONE:
                if every and i % every == 0:
                    ev.progress(i)
                if i == n:
                    break
                continue
            if why == DOUBLE:
                result.double_free = (int(ev.addr[i]), i, int(out[0]))
                break
            if why == SLOT:
                a.slot_bit(int(rec_stream[match[i]]))
                a.slot_bit(int(ev.stream[i]))
                continue
            size, stream = int(ev.size[i]), int(ev.stream[i])
            try:
                if why == FULL:
                    a.allocate(size, stream)  # raises: no allocator serves that size
                    raise AssertionError(f"paged: a request of {size} bytes was expected to fail")
                if why == PLACE:
                    resume = a.alloc_block(size, stream)
                elif why == ORDER:  # mapped in the loop; finish_block's order_after waits here
                    heap = a.small if out[0] else a.large
                    a.wait_for(stream, int(out[2]))
                    resume = heap.base + (int(out[1]) << heap.unit_shift)
                elif why == MAP_FAILED:
                    heap = a.small if out[0] else a.large
                    e = a.driver.error(code, "create" if code == CD.E_OOM else "map", va=va, size=a.page)
                    err = a.mapping_failed(heap, int(out[1]), size, int(out[2]), e)
                    if not isinstance(err, OutOfMemoryError):
                        raise AssertionError(f"paged: a driver call of the compiled replay failed: {err}") from err
                    raise err
                else:
                    heap = a.small if out[0] else a.large
                    resume = a.finish_block(heap, int(out[1]), size, int(out[2]), stream)
            except OutOfMemoryError as err:
                if why != FULL:
                    a.note_oom()  # as Allocator.allocate counts it
                result.oom_event, result.oom_message = i, str(err)
                break
    finally:
        result.done = i
        _write_back(a, ev, st, rec_ptr, rec_size, rec_stream, rec_live, rec_freed, npre)
    result.unmatched = int(st[S_UNMATCHED])
    if ev.timeline:
        result.allocated, result.reserved = tl_alloc[:i], tl_res[:i]
    return result


def _write_back(a, ev, st, rec_ptr, rec_size, rec_stream, rec_live, rec_freed, npre) -> None:
    """Report to the base class (:meth:`Allocator.report_compiled`) the state the Python replay
    leaves: counters, live allocations in allocation order, their streams, and the recently
    freed addresses (the latest frees; where allocations in between shrank that memory, the
    Python replay may have forgotten a few older ones: it only names a later double free)."""
    from vmstoolkit.pools.base import _FREED_MEMORY

    a.counts["fast"] += int(st[S_FAST])
    home = int(st[S_HOME]) if st[S_HAS_HOME] else a.stream_home()
    pre_gone = {int(p) for p in rec_ptr[:npre][rec_live[:npre] == 0]}
    live = {p: s for p, s in a.live_allocations().items() if p not in pre_gone}
    stream_of = {p: s for p, s in a.block_streams().items() if p not in pre_gone}
    idx = npre + np.flatnonzero(rec_live[npre:])
    for p, s, t in zip(rec_ptr[idx].tolist(), rec_size[idx].tolist(), rec_stream[idx].tolist()):
        live[p] = s
        if t != home:
            stream_of[p] = t
    freed = np.flatnonzero(rec_freed >= 0)
    latest = []
    if len(freed):
        order = freed[np.argsort(rec_freed[freed], kind="stable")][::-1]  # latest free first
        ptrs = rec_ptr[order]
        _, first = np.unique(ptrs, return_index=True)
        latest = [p for p in ptrs[np.sort(first)].tolist() if p not in live][:_FREED_MEMORY][::-1]
    a.report_compiled(st[:S_FAST], live=live, stream_of=stream_of, home=home, freed=latest)
