"""The simulated driver's book-keeping in Numba-compiled arrays: the same driver, faster.

:class:`CompiledSimulatedDriver` is a drop-in for
:class:`~vmstoolkit.pools.drivers.sim.SimulatedDriver` (the readable reference): the same
calls, the same results, the same errors with the same messages, the same fault injection,
queued work, events and race detection (those stay in Python, in the parent class: replays
rarely use them). What moves into compiled code is what every replayed event pays for:
handles, reservations, mappings and plain allocations, each a sorted table of int64 rows,
searched by bisection. ``tests/pools/drivers/test_compiled_driver.py`` runs both drivers on
random programs (hypothesis), faults included, and compares every call and the final state.

Layout (``_S`` scalars, and one 2-D table per kind of object; ``n*`` rows in use):

=======  =============================================  ==========================================
table    row                                            order
=======  =============================================  ==========================================
``_H``   size, state (0 gone, 1 live, 2 released but    indexed by handle (handles count from 1)
         mapped), number of mappings
``_R``   start, size                                    by start (appended: addresses only grow)
``_M``   start, size, handle, offset, accessible        by start, around a gap (see below)
``_A``   start, size                                    by start (appended)
=======  =============================================  ==========================================

Each compiled operation returns 0, an error code (its values in ``_S[S_E0:]``, which the
Python side formats into the reference's message), or ``GROW``: a table is full and nothing
was changed; the caller doubles it and calls again. Cost per call: a bisection, plus, for a
map or an unmap, moving the gap of the mappings' table there.

The mappings' table is a gap buffer: its free rows sit at logical row ``_S[S_GAP]`` (rows before
it in place, rows from it on at the end of the array), so an insert or a removal moves only the
rows between the last change and this one. A pool maps and unmaps runs of neighbouring pages:
with the gap kept at the end, each change moved every row after it (12 us a map and unmap at
6,000 mappings, most of a 500k-event ``paged`` replay); Python readers see it closed
(:func:`_close_gap`).
"""

from __future__ import annotations

import numpy as np

from vmstoolkit._jit import njit
from vmstoolkit.errors import DriverError, DriverOutOfMemoryError
from vmstoolkit.pools.drivers.base import Handle
from vmstoolkit.pools.drivers.sim import GRANULARITY, VA_BASE, SimulatedDriver
from vmstoolkit.pools.drivers.txn import StepRun

# scalars
S_CAP, S_GRAN, S_NEXT_VA, S_NEXT_H, S_LIVE_HB, S_ALLOC_B, S_NR, S_NM, S_NA, S_E0, S_E1, S_E2, S_GAP, S_NS = range(14)
# columns
H_SIZE, H_STATE, H_NMAPS = range(3)
M_START, M_SIZE, M_HANDLE, M_OFFSET, M_ACCESS = range(5)
# results
OK, GROW, E_OOM, E_HANDLE, E_RES_MATCH, E_RES_MAPPED, E_ALIGN, E_OFFSET, E_RANGE, E_OVERLAP, E_UNMAP_WHOLE, \
    E_UNMAP_HOLE, E_HOLE, E_ACCESS, E_PTR, E_PARTIAL = range(16)


@njit(cache=True)
def _bisect(t, n, x, right, gap, gl):
    """Logical rows of ``t[:n]`` whose start (column 0) is below ``x`` (at most ``x`` with
    ``right``); logical rows from ``gap`` on sit ``gl`` array rows further (the mappings' gap)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        s = t[mid if mid < gap else mid + gl, 0]
        if s < x or (right and s == x):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _bisect_right(t, n, x):
    """Rows of ``t[:n]`` whose start (column 0) is at most ``x``."""
    return _bisect(t, n, x, True, n, 0)


@njit(cache=True)
def _bisect_left(t, n, x):
    return _bisect(t, n, x, False, n, 0)


@njit(cache=True)
def _p(S, M, i):
    """The array row of the mappings' logical row ``i`` (rows from the gap on sit past it)."""
    return i if i < S[S_GAP] else i + M.shape[0] - S[S_NM]


@njit(cache=True)
def _move_gap(S, M, to):
    """Put the gap at logical row ``to``: the rows between it and there move across it."""
    g = S[S_GAP]
    gl = M.shape[0] - S[S_NM]
    if gl > 0:
        if to < g:  # rows [to, g) go up past the gap, the last first
            for j in range(g - 1, to - 1, -1):
                for c in range(5):
                    M[j + gl, c] = M[j, c]
        else:  # rows [g, to) come down from past it, the first first
            for j in range(g, to):
                for c in range(5):
                    M[j, c] = M[j + gl, c]
    S[S_GAP] = to


@njit(cache=True)
def _close_gap(S, M):
    """The gap at the end: logical rows are array rows (for Python readers, and before a table grows)."""
    _move_gap(S, M, S[S_NM])


@njit(cache=True)
def _mstart(S, M, i):
    return M[_p(S, M, i), M_START]


@njit(cache=True)
def _mbisect_right(S, M, x):
    """Mappings whose start is at most ``x``."""
    return _bisect(M, S[S_NM], x, True, S[S_GAP], M.shape[0] - S[S_NM])


@njit(cache=True)
def _mbisect_left(S, M, x):
    return _bisect(M, S[S_NM], x, False, S[S_GAP], M.shape[0] - S[S_NM])


@njit(cache=True)
def _overlapping(S, M, va, size):
    """Logical rows ``[first, last)`` of the mappings overlapping ``[va, va+size)`` (the
    reference's ``_overlapping``: the mapping at or before ``va`` if it reaches past it, then
    every one starting inside)."""
    i = _mbisect_right(S, M, va)
    if i > 0:
        r = _p(S, M, i - 1)
        if M[r, M_START] == va and M[r, M_SIZE] >= size:
            return i - 1, i
        first = i - 1 if M[r, M_START] + M[r, M_SIZE] > va else i
    else:
        first = i
    last = max(i, _mbisect_left(S, M, va + size))
    return first, last


@njit(cache=True)
def _covered(S, M, va, size):
    """Rows ``[first, last)`` covering ``[va, va+size)`` without a hole; ``last`` -1: a hole
    at ``S[S_E0]``."""
    first, last = _overlapping(S, M, va, size)
    pos = va
    j = first
    while j < last:
        r = _p(S, M, j)
        s = M[r, M_START]
        if s > pos:
            break
        pos = max(pos, s + M[r, M_SIZE])
        j += 1
    if pos < va + size:
        S[S_E0] = pos
        return first, -1
    return first, j


@njit(cache=True)
def _create(S, H, size):
    in_use = S[S_LIVE_HB] + S[S_ALLOC_B]
    if in_use + size > S[S_CAP]:
        S[S_E0] = in_use
        return E_OOM
    h = S[S_NEXT_H]
    if h >= H.shape[0]:
        return GROW
    S[S_NEXT_H] = h + 1
    H[h, H_SIZE] = size
    H[h, H_STATE] = 1
    H[h, H_NMAPS] = 0
    S[S_LIVE_HB] += size
    S[S_E0] = h
    return OK


@njit(cache=True)
def _release(S, H, h):
    if h < 1 or h >= H.shape[0] or H[h, H_STATE] != 1:
        return E_HANDLE
    if H[h, H_NMAPS] > 0:
        H[h, H_STATE] = 2  # freed when its last mapping goes, as in CUDA
    else:
        H[h, H_STATE] = 0
        S[S_LIVE_HB] -= H[h, H_SIZE]
    return OK


@njit(cache=True)
def _reserve(S, R, size, alignment):
    nr = S[S_NR]
    if nr >= R.shape[0]:
        return GROW
    align = max(alignment, S[S_GRAN])
    va = -((-S[S_NEXT_VA]) // align) * align
    S[S_NEXT_VA] = va + size
    R[nr, 0] = va
    R[nr, 1] = size
    S[S_NR] = nr + 1
    S[S_E0] = va
    return OK


@njit(cache=True)
def _free_address(S, R, M, va, size):
    nr = S[S_NR]
    i = _bisect_left(R, nr, va)
    if i >= nr or R[i, 0] != va or R[i, 1] != size:
        return E_RES_MATCH
    first, last = _overlapping(S, M, va, size)
    if last > first:
        return E_RES_MAPPED
    R[i:nr - 1] = R[i + 1:nr].copy()
    S[S_NR] = nr - 1
    return OK


@njit(cache=True)
def _map(S, H, R, M, va, size, h, offset):
    g = S[S_GRAN]
    if va % g or size % g or offset % g or size <= 0:
        return E_ALIGN
    code = _handle_fits(S, H, h, size, offset)
    if code:
        return code
    r = _bisect_right(R, S[S_NR], va) - 1
    if r < 0 or not (R[r, 0] <= va and va + size <= R[r, 0] + R[r, 1]):
        return E_RANGE
    first, last = _overlapping(S, M, va, size)
    if last > first:
        return E_OVERLAP
    if S[S_NM] >= M.shape[0]:
        return GROW
    _insert_mapping(S, H, M, _mbisect_right(S, M, va), va, size, h, offset)
    return OK


@njit(cache=True)
def _handle_fits(S, H, h, size, offset):
    """The checks of :func:`_map` on the handle: live, and mapped whole (0, or its error code)."""
    if h < 1 or h >= H.shape[0] or H[h, H_STATE] != 1:
        return E_HANDLE
    if offset + size > H[h, H_SIZE]:
        S[S_E0] = H[h, H_SIZE]
        return E_OFFSET
    if offset or size != H[h, H_SIZE]:  # a handle is mapped only whole (Note [whole handles])
        S[S_E0] = H[h, H_SIZE]
        return E_PARTIAL
    return OK


@njit(cache=True)
def _insert_mapping(S, H, M, i, va, size, h, offset):
    """The new mapping at logical row ``i`` (where it sorts; the table has room)."""
    _move_gap(S, M, i)  # the new row takes the gap's first
    S[S_GAP] = i + 1
    M[i, M_START] = va
    M[i, M_SIZE] = size
    M[i, M_HANDLE] = h
    M[i, M_OFFSET] = offset
    M[i, M_ACCESS] = 0
    S[S_NM] += 1
    H[h, H_NMAPS] += 1


@njit(cache=True)
def _run_fits(S, R, M, va, size, count):
    """Whether ``count`` maps of ``size`` bytes from ``va`` on pass :func:`_map`'s checks on
    the addresses: aligned, inside one reservation, overlapping no mapping (nor each other).
    Then the ``i``-th one's row is the ``i``-th after where ``va`` sorts."""
    g = S[S_GRAN]
    if va % g or size % g or size <= 0:
        return False
    end = va + count * size
    r = _bisect_right(R, S[S_NR], va) - 1
    if r < 0 or not (R[r, 0] <= va and end <= R[r, 0] + R[r, 1]):
        return False
    first, last = _overlapping(S, M, va, end - va)
    return last <= first


@njit(cache=True)
def _unmap(S, H, M, va, size):
    nm = S[S_NM]
    first, last = _overlapping(S, M, va, size)
    covered = 0
    for j in range(first, last):
        covered += M[_p(S, M, j), M_SIZE]
    if last == first or _mstart(S, M, first) != va or covered != size:
        return E_UNMAP_WHOLE
    pos = va
    for j in range(first, last):
        r = _p(S, M, j)
        if M[r, M_START] != pos:
            S[S_E0] = pos
            return E_UNMAP_HOLE
        pos += M[r, M_SIZE]
    for j in range(first, last):
        h = M[_p(S, M, j), M_HANDLE]
        H[h, H_NMAPS] -= 1
        if H[h, H_NMAPS] == 0 and H[h, H_STATE] == 2:
            H[h, H_STATE] = 0
            S[S_LIVE_HB] -= H[h, H_SIZE]
    _move_gap(S, M, last)  # the removed rows join the gap, just before it
    S[S_GAP] = first
    S[S_NM] = nm - (last - first)
    return OK


@njit(cache=True)
def _create_mapped(S, H, R, M, va, size, count, out):
    """``count`` creates, each followed by its map (the tables have room for them). Returns
    ``(code, made, mapped)``: the first failure's code (0: none) and how many handles were made
    and mapped before it; ``out[:made]`` holds the handles."""
    fits = _run_fits(S, R, M, va, size, count)  # then every map passes (a new handle is mapped whole)
    row = _mbisect_right(S, M, va) if fits else 0
    for i in range(count):
        code = _create(S, H, size)
        if code:
            return code, i, i
        h = S[S_E0]
        out[i] = h
        if fits:
            _insert_mapping(S, H, M, row + i, va + i * size, size, h, 0)
        else:
            code = _map(S, H, R, M, va + i * size, size, h, 0)
            if code:
                return code, i + 1, i
    return OK, count, count


@njit(cache=True)
def _map_many(S, H, R, M, va, size, hs):
    """Map ``hs[i]`` at ``va + i * size`` in order (the table has room). Returns ``(code, mapped)``."""
    if _run_fits(S, R, M, va, size, hs.shape[0]):  # only the handles are left to check, one by one
        row = _mbisect_right(S, M, va)
        for i in range(hs.shape[0]):
            code = _handle_fits(S, H, hs[i], size, 0)
            if code:
                return code, i
            _insert_mapping(S, H, M, row + i, va + i * size, size, hs[i], 0)
        return OK, hs.shape[0]
    for i in range(hs.shape[0]):
        code = _map(S, H, R, M, va + i * size, size, hs[i], 0)
        if code:
            return code, i
    return OK, hs.shape[0]


@njit(cache=True)
def _set_access(S, M, va, size):
    first, last = _covered(S, M, va, size)
    if last < 0:
        return E_HOLE
    for j in range(first, last):
        M[_p(S, M, j), M_ACCESS] = 1
    return OK


@njit(cache=True)
def _memset(S, M, A, va, size):
    i = _bisect_right(A, S[S_NA], va) - 1
    if i >= 0 and A[i, 0] <= va and va + size <= A[i, 0] + A[i, 1]:
        return OK  # inside a plain allocation
    first, last = _covered(S, M, va, size)
    if last < 0:
        return E_HOLE
    for j in range(first, last):
        if M[_p(S, M, j), M_ACCESS] == 0:
            return E_ACCESS
    return OK


@njit(cache=True)
def _mem_alloc(S, A, size):
    in_use = S[S_LIVE_HB] + S[S_ALLOC_B]
    if in_use + size > S[S_CAP]:
        S[S_E0] = in_use
        return E_OOM
    na = S[S_NA]
    if na >= A.shape[0]:
        return GROW
    va = -((-S[S_NEXT_VA]) // 512) * 512
    S[S_NEXT_VA] = va + size
    A[na, 0] = va
    A[na, 1] = size
    S[S_NA] = na + 1
    S[S_ALLOC_B] += size
    S[S_E0] = va
    return OK


@njit(cache=True)
def _mem_free(S, A, ptr):
    na = S[S_NA]
    i = _bisect_left(A, na, ptr)
    if i >= na or A[i, 0] != ptr:
        return E_PTR
    S[S_ALLOC_B] -= A[i, 1]
    A[i:na - 1] = A[i + 1:na].copy()
    S[S_NA] = na - 1
    return OK


def _grown(t: np.ndarray) -> np.ndarray:
    b = np.zeros((2 * t.shape[0],) + t.shape[1:], dtype=t.dtype)
    b[: t.shape[0]] = t
    return b


_INVALID = "CUDA_ERROR_INVALID_VALUE"
_ERRORS = {
    E_OOM: ("CUDA_ERROR_OUT_OF_MEMORY", "{call} of {size} bytes with {e0} of {cap} in use"),
    E_HANDLE: (_INVALID, "{call} of unknown or released handle {handle}"),
    E_RES_MATCH: (_INVALID, "cuMemAddressFree({va:#x}, {size}) does not match a reservation"),
    E_RES_MAPPED: (_INVALID, "cuMemAddressFree({va:#x}, {size}) of a range that is still mapped"),
    E_ALIGN: (_INVALID, "cuMemMap({va:#x}, {size}, offset={offset}) is not aligned to {g}"),
    E_OFFSET: (_INVALID, "cuMemMap of {size} bytes at offset {offset} of a {e0}-byte handle"),
    E_PARTIAL: ("CUDA_ERROR_NOT_SUPPORTED", "cuMemMap of {size} bytes at offset {offset} of a {e0}-byte handle: "
                                            "a handle is mapped only whole"),
    E_RANGE: (_INVALID, "range [{va:#x}, +{size}) is not inside one reserved range"),
    E_OVERLAP: (_INVALID, "cuMemMap({va:#x}, {size}) overlaps an existing mapping"),
    E_UNMAP_WHOLE: (_INVALID, "cuMemUnmap({va:#x}, {size}) does not cover whole mappings exactly"),
    E_UNMAP_HOLE: (_INVALID, "cuMemUnmap({va:#x}, {size}) spans a hole at {e0:#x}"),
    E_HOLE: (_INVALID, "range [{va:#x}, +{size}) is not fully mapped (hole at {e0:#x})"),
    E_ACCESS: ("CUDA_ERROR_ILLEGAL_ADDRESS", "memset of [{va:#x}, +{size}) touches a mapping without access rights"),
    E_PTR: (_INVALID, "cuMemFree of unknown pointer {va:#x}"),
}
"""Result code -> (CUresult, message template): the reference driver's messages, filled in by
``_raise`` (``e0``: the value the compiled operation left in ``_S[S_E0]``)."""
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class CompiledSimulatedDriver(SimulatedDriver):
    """See the module docstring; constructed like :class:`SimulatedDriver`."""

    def _init_memory(self) -> None:
        S = np.zeros(S_NS, dtype=np.int64)
        S[S_CAP] = self._capacity
        S[S_GRAN] = self._granularity
        S[S_NEXT_VA] = VA_BASE
        S[S_NEXT_H] = 1
        self._S = S
        self._H = np.zeros((1024, 3), dtype=np.int64)
        self._R = np.zeros((256, 2), dtype=np.int64)
        self._M = np.zeros((1024, 5), dtype=np.int64)
        self._A = np.zeros((256, 2), dtype=np.int64)

    def _raise(self, code: int, op: str, va: int = 0, size: int = 0, handle: int = 0, offset: int = 0) -> None:
        """Raise :meth:`error`."""
        raise self.error(code, op, va=va, size=size, handle=handle, offset=offset)

    def error(self, code: int, op: str, va: int = 0, size: int = 0, handle: int = 0, offset: int = 0) -> DriverError:
        """The reference driver's error for the result ``code`` of a compiled operation on ``op``
        (its message, word for word: :data:`_ERRORS`), for callers of :meth:`compiled_tables`
        too. Runtime complexity: O(1)."""
        if code not in _ERRORS:  # pragma: no cover - a compiled result without a message
            raise AssertionError(f"compiled driver: unknown result {code}")
        result, template = _ERRORS[code]
        cls = DriverOutOfMemoryError if result == "CUDA_ERROR_OUT_OF_MEMORY" else DriverError
        call = {"create": "cuMemCreate", "mem_alloc": "cuMemAlloc", "release": "cuMemRelease"}.get(op, "cuMemMap")
        return cls(result, template.format(va=va, size=size, handle=handle, offset=offset, g=self._granularity,
                                           cap=self._capacity, e0=int(self._S[S_E0]), call=call))

    # -- physical memory -------------------------------------------------------------------
    def _in_use(self) -> int:
        return int(self._S[S_LIVE_HB] + self._S[S_ALLOC_B])

    def _create(self, size: int) -> Handle:
        while (code := _create(self._S, self._H, size)) == GROW:
            self._H = _grown(self._H)
        if code:
            self._raise(code, "create", size=size)
        return int(self._S[S_E0])

    def _release(self, handle: Handle) -> None:
        code = _release(self._S, self._H, handle) if _INT64_MIN <= handle <= _INT64_MAX else E_HANDLE
        if code:
            self._raise(code, "release", handle=handle)

    # -- virtual ranges --------------------------------------------------------------------
    def _reserve(self, size: int, alignment: int) -> int:
        while (code := _reserve(self._S, self._R, size, alignment)) == GROW:
            self._R = _grown(self._R)
        return int(self._S[S_E0])

    def _free_address(self, va: int, size: int) -> None:
        code = _free_address(self._S, self._R, self._M, va, size)
        if code:
            self._raise(code, "free_address", va=va, size=size)

    def _map(self, va: int, size: int, handle: Handle, offset: int) -> None:
        if not _INT64_MIN <= handle <= _INT64_MAX:  # no such handle, after the alignment check
            g = self._granularity
            code = E_ALIGN if (va % g or size % g or offset % g or size <= 0) else E_HANDLE
        else:
            while (code := _map(self._S, self._H, self._R, self._M, va, size, handle, offset)) == GROW:
                self._grow_mappings()
        if code:
            self._raise(code, "map", va=va, size=size, handle=handle, offset=offset)

    # -- batched calls: one compiled loop for a pool's chunk-by-chunk sequence -----------------
    # A 2 MiB chunk is one create and one map: a vms replay made 1.6 driver calls per event,
    # each a Python template call around a compiled one (about 2 us); one batch per block
    # (llama-full: 33.7k calls in 2.3k batches) took vms on llama-full.caching from 0.43x to
    # 0.48x of pytorch-caching's events/s (benchmarks/replay_speed.py, ratios within each run).
    def _faults_within(self, op: str, count: int) -> bool:
        """An injected fault falls on one of the next ``count`` calls of ``op``."""
        faults = self._faults.get(op)
        if not faults:
            return False
        n0 = self.calls[op]
        return any(n0 < n <= n0 + count for n in faults)

    def _room(self, handles: int, mappings: int) -> None:
        """Grow the tables until ``handles`` more handles and ``mappings`` more mappings fit."""
        while int(self._S[S_NEXT_H]) + handles >= self._H.shape[0]:
            self._H = _grown(self._H)
        while int(self._S[S_NM]) + mappings > self._M.shape[0]:
            self._grow_mappings()

    def _grow_mappings(self) -> None:
        """Twice the mappings' rows (the gap closed first: the new rows extend it)."""
        _close_gap(self._S, self._M)
        self._M = _grown(self._M)

    def create_mapped(self, va: int, size: int, count: int, tx) -> list[Handle]:
        """:meth:`VMMDriver.create_mapped <vmstoolkit.pools.drivers.base.VMMDriver.create_mapped>`
        in one compiled loop, with the same counts, accounting, undos and errors; the reference
        loop where an injected fault falls inside it or a value is out of the tables' range.
        Runtime complexity: O(count * log(m) + the gap's move) in live mappings m, ``2 * count``
        counted driver calls in one Python call (the undos registered as one :class:`~vmstoolkit.pools.drivers.txn.StepRun`)."""
        if (count <= 0 or size <= 0 or size % self._granularity or not 0 <= va <= _INT64_MAX - count * size
                or self._faults_within("create", count) or self._faults_within("map", count)):
            return super().create_mapped(va, size, count, tx)
        self._room(count, count)
        out = np.empty(count, np.int64)
        code, made, mapped = _create_mapped(self._S, self._H, self._R, self._M, va, size, count, out)
        failed_map = bool(code) and made > mapped
        calls = self.calls
        calls["create"] += made + (1 if code and not failed_map else 0)
        if mapped or failed_map:
            calls["map"] += mapped + failed_map
        handles = out[:made].tolist()
        self._handle_sizes.update(dict.fromkeys(handles, size))
        if made:
            self._grow(made * size)
        tx.undo_steps(StepRun(va, size, handles, mapped))  # a release, then an unmap, per chunk
        if code:
            if failed_map:
                self._raise(code, "map", va=va + mapped * size, size=size, handle=handles[-1], offset=0)
            self._raise(code, "create", size=size)
        return handles

    def map_many(self, va: int, size: int, handles: list[Handle], tx) -> None:
        """:meth:`VMMDriver.map_many <vmstoolkit.pools.drivers.base.VMMDriver.map_many>` in one
        compiled loop, with the same counts, undos and errors (the reference loop where an injected
        fault falls inside it or a value is out of the tables' range). Runtime complexity:
        O(len(handles) * log(m) + the gap's move), ``len(handles)`` counted maps in one Python call."""
        count = len(handles)
        try:
            hs = np.array(handles, np.int64)
        except OverflowError:
            hs = None
        if (hs is None or count == 0 or not 0 <= va <= _INT64_MAX - count * max(size, 0)
                or self._faults_within("map", count)):
            return super().map_many(va, size, handles, tx)
        self._room(0, count)
        code, mapped = _map_many(self._S, self._H, self._R, self._M, va, size, hs)
        self.calls["map"] += mapped + (1 if code else 0)
        tx.undo_steps(StepRun(va, size, None, mapped))  # an unmap per chunk mapped
        if code:
            self._raise(code, "map", va=va + mapped * size, size=size, handle=handles[mapped], offset=0)

    # -- compiled callers: an allocator's own compiled loop calling the operations above ----------
    # paged's compiled replay maps its pages from its njit loop (pools/paged/driver_work.py): no
    # Python call per driver call, and no return to Python per block that needs pages.
    def compiled_tables(self, handles: int, mappings: int) -> tuple | None:
        """``(S, H, R, M)``, with room for ``handles`` more handles and ``mappings`` more
        mappings, for compiled code that calls this module's ``_create``, ``_map``, ``_unmap`` and
        ``_set_access`` on them directly and reports what it did with :meth:`account_compiled`;
        ``None`` while an injected fault is planned or work is queued (:meth:`enqueue_use`), which
        only the Python calls see. The arrays stay valid until the next Python call that grows
        a table. Runtime complexity: O(1), or a table's copy when it grows."""
        if any(self._faults.values()) or self._queued:
            return None
        self._room(handles, mappings)
        return self._S, self._H, self._R, self._M

    def account_compiled(self, calls: dict[str, int], new_handles: list[Handle], size: int, syncs: int) -> None:
        """Take on what compiled code did straight on :meth:`compiled_tables`, as the template
        would have counted it: ``calls`` (operation -> calls, failed ones included),
        ``new_handles`` of ``size`` bytes each (created in that order, none released),
        ``syncs`` synchronizes (no work was queued). Runtime complexity: O(new handles)."""
        for op, n in calls.items():
            if n:
                self.calls[op] += n
        sizes = self._handle_sizes
        for h in new_handles:
            sizes[h] = size
        if new_handles:
            self._grow(len(new_handles) * size)  # only grows in between: the peak is the same
        self.syncs += syncs

    def _unmap(self, va: int, size: int) -> None:
        self._check_queued(va, size)
        code = _unmap(self._S, self._H, self._M, va, size)
        if code:
            self._raise(code, "unmap", va=va, size=size)

    def _set_access(self, va: int, size: int) -> None:
        code = _set_access(self._S, self._M, va, size)
        if code:
            self._raise(code, "set_access", va=va, size=size)

    def _memset(self, va: int, size: int, value: int) -> None:
        code = _memset(self._S, self._M, self._A, va, size)
        if code:
            self._raise(code, "memset", va=va, size=size)

    # -- plain allocations -----------------------------------------------------------------
    def _mem_alloc(self, size: int) -> int:
        while (code := _mem_alloc(self._S, self._A, size)) == GROW:
            self._A = _grown(self._A)
        if code:
            self._raise(code, "mem_alloc", size=size)
        return int(self._S[S_E0])

    def _mem_free(self, ptr: int) -> None:
        code = _mem_free(self._S, self._A, ptr) if _INT64_MIN <= ptr <= _INT64_MAX else E_PTR
        if code:
            self._raise(code, "mem_free", va=ptr)

    def _mem_info(self) -> tuple[int, int]:
        return self._capacity - self._in_use(), self._capacity

    def _physical(self, va: int, size: int) -> list[tuple[object, int, int]]:
        _close_gap(self._S, self._M)
        first, last = _overlapping(self._S, self._M, va, size)
        out = []
        for s, msize, h, off in self._M[first:last, :4].tolist():
            lo, hi = max(va, s), min(va + size, s + msize)
            out.append((h, off + lo - s, off + hi - s))
        if not out:
            out.append(("va", va, va + size))
        return out

    # -- introspection ---------------------------------------------------------------------
    def aliases(self, handle: Handle) -> int:
        """How many mappings ``handle`` has now (0 for an unknown or fully released handle). O(1)."""
        H = self._H
        if not 1 <= handle < H.shape[0] or H[handle, H_STATE] == 0:
            return 0
        return int(H[handle, H_NMAPS])

    def live_handles(self) -> set[Handle]:
        """Handles created and not yet released. O(handles ever created)."""
        n = int(self._S[S_NEXT_H])
        return set((np.flatnonzero(self._H[:n, H_STATE] == 1)).tolist())

    def live_reservations(self) -> dict[int, int]:
        """address -> size of every live reservation. O(reservations)."""
        return dict(self._R[: self._S[S_NR]].tolist())

    def live_mappings(self) -> dict[int, tuple[int, Handle]]:
        """va -> (size, handle) of every mapping. O(mappings)."""
        _close_gap(self._S, self._M)
        return {s: (size, h) for s, size, h in self._M[: self._S[S_NM], :3].tolist()}

    def live_allocs(self) -> dict[int, int]:
        """address -> size of every live :meth:`mem_alloc` allocation. O(allocations)."""
        return dict(self._A[: self._S[S_NA]].tolist())

    @property
    def _mappings(self) -> dict:
        return self.live_mappings()

    @property
    def _reservations(self) -> dict:
        return self.live_reservations()

    def _handles_alive(self) -> tuple[int, int]:
        st = self._H[: int(self._S[S_NEXT_H]), H_STATE]
        return int(np.count_nonzero(st)), int(np.count_nonzero(st == 2))

    def is_empty(self) -> bool:
        """True when nothing is created, reserved, mapped or allocated: nothing leaked. O(handles ever
        created)."""
        S = self._S
        return not (self._handles_alive()[0] or S[S_NR] or S[S_NM] or S[S_NA])

    def leak_report(self) -> str:
        """One line counting what is still alive (handles, those released but mapped, reservations,
        mappings, plain allocations), for a leak's error. O(handles ever created)."""
        alive, released = self._handles_alive()
        S = self._S
        return (f"{alive} handles ({released} released but mapped), {int(S[S_NR])} reservations, "
                f"{int(S[S_NM])} mappings, {int(S[S_NA])} plain allocations")


__all__ = ["CompiledSimulatedDriver", "GRANULARITY"]
