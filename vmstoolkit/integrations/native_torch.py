"""PyTorch's allocation hook served by compiled code: the ``paged`` allocator with no Python on
the common path.

PyTorch calls two C function pointers for every allocation and free. Here they are Numba
``cfunc``s that run the ``paged`` heap (:mod:`vmstoolkit.pools.paged.heap`) directly on its
arrays: an allocation whose pages are already mapped and every free cost a few hundred
nanoseconds and no Python. Only when the driver has work to do (pages to map, chunks to create
or reclaim), or a device is used for the first time, do they call back into Python
(:class:`~vmstoolkit.pools.paged.allocator.PagedAllocator`, which does the driver calls).

Serialisation is the GIL: the cfuncs take it (``PyGILState_Ensure``; a thread's first call pins
a thread state for it, as :mod:`~vmstoolkit.integrations.callbacks` does), so the heap is never
touched by two threads at once, and the Python slow path, which holds the GIL too, marks the
device busy while it works: a fast path that finds it busy takes the slow path, which waits on
the allocator's lock (releasing the GIL meanwhile). Nothing can raise into C++: a failure
returns the null pointer, is kept in ``last_error`` and reported on standard error (PyTorch does
not check the pointer; :func:`~vmstoolkit.integrations.bridge.report_failed_malloc`); a free of
an unknown pointer is counted in ``bad_frees``.

The cfuncs find each device's arrays through one table of addresses (:data:`TABLE`), filled
when the device's allocator is made; the table and the arrays live as long as the process
(PyTorch keeps the pointers).
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager

import numpy as np
from vmstoolkit._jit import njit

from vmstoolkit.errors import IntegrationError, OutOfMemoryError
from vmstoolkit.integrations.abi import ALLOC_FN, FREE_FN  # noqa: F401 (re-exported for callers)
from vmstoolkit.integrations.bridge import per_device, report_failed_malloc, torch_stats
from vmstoolkit.integrations.torch import HookBase
from vmstoolkit.pools.adaptors import past_limit
from vmstoolkit.pools.base import Allocator, AllocatorStats, C_ALLOCATED, count_alloc, count_free
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.paged.allocator import G_NSLOTS, MAX_SLOTS, OVERFLOW_BIT, SMALL_SIZE, PagedAllocator

MAX_DEVICES = 16
N_HEAP_ARRAYS = 17
# one row per device: ready, g, bases and sizes, unit shifts, the stream slots, then (address,
# length) of each heap array
R_READY, R_G, R_G_LEN = 0, 1, 2
R_LARGE_BASE, R_LARGE_BYTES, R_SMALL_BASE, R_SMALL_BYTES, R_LARGE_SHIFT, R_SMALL_SHIFT = 3, 4, 5, 6, 7, 8
R_SLOTS = 9  # address of the allocator's stream_slots (g[G_NSLOTS] of them in use)
R_HEAPS = 10  # large heap arrays at R_HEAPS, small heap arrays at R_HEAPS + 2 * N_HEAP_ARRAYS
ROW = R_HEAPS + 4 * N_HEAP_ARRAYS
TABLE = np.zeros(MAX_DEVICES * ROW, np.int64)

# g[] slots the hook uses (heap.py uses 0-5, the allocator's G_NSLOTS 13): the request counters,
# laid out as Allocator.COUNTERS and kept by pools.base's count_alloc/count_free, so that the
# allocator reads them (Allocator.stats_of) as it reads its own; then the frees of unknown pointers
G_COUNTERS = 6
G_BAD_FREES = 14
assert G_COUNTERS + len(Allocator.COUNTERS) <= G_NSLOTS, "the hook's counters overlap the allocator's g slots"

SLOW_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64)  # (size, device, stream) -> ptr
SLOW_MAP_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
                               ctypes.c_int64)  # (device, heap, start, n, size, stream) -> 1 on success
SLOW_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64)
SLOW_WAIT_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)  # (device, stream, slot bits)


def _pyapi(name: str, restype, *argtypes):
    fn = getattr(ctypes.pythonapi, name)
    return ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.cast(fn, ctypes.c_void_p).value)


_gil_this_state = _pyapi("PyGILState_GetThisThreadState", ctypes.c_void_p)
_gil_ensure = _pyapi("PyGILState_Ensure", ctypes.c_int)
_gil_release = _pyapi("PyGILState_Release", None, ctypes.c_int)


@njit(inline="always")
def take_gil():
    """``PyGILState_Ensure`` for a compiled entry point, returning the state to hand to
    ``_gil_release``. A thread's first call pins its Python thread state for the thread's
    lifetime (one more Ensure, never released), so later calls only take the GIL."""
    fresh = _gil_this_state() == 0
    st = _gil_ensure()
    if fresh:
        _gil_ensure()
    return st


def pointer_to(t):
    """A Numba intrinsic that makes an int64 address a pointer to ``t`` (for ``carray``)."""
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def cast(typingctx, addr):
        sig = types.CPointer(t)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return cast


class NativeDevice:
    """One device's ``paged`` allocator and the hook's counters, in the bridge's vocabulary
    (``allocator``, ``seconds``: time in the Python slow path, ``failed_mallocs``).

    The requests the hook serves never reach :meth:`Allocator.allocate`: they are counted in
    ``counters`` (a view of ``g``, laid out as :data:`Allocator.COUNTERS`) by the fast path and the
    slow path alike, out-of-memory failures by :meth:`Allocator.note_oom`, and the allocator reads
    and resets them through its documented calls (:meth:`Allocator.stats_of`, ``reset_peaks_of``,
    ``reset_totals_of``): the figures ``torch.cuda`` shows are those the Python path gives."""

    def __init__(self, allocator: PagedAllocator) -> None:
        self.allocator = allocator
        self.g = allocator.g
        self.counters = self.g[G_COUNTERS:G_COUNTERS + len(Allocator.COUNTERS)]  # a view
        self.seconds = 0.0
        self.failed_mallocs = 0
        self.last_error: BaseException | None = None

    @property
    def bad_frees(self) -> int:
        """Frees of pointers the hook never handed out (counted, never raised into C)."""
        return int(self.g[G_BAD_FREES])

    def allocator_stats(self) -> AllocatorStats:
        """The hook's requests (allocated: bytes PyTorch asked for) and the driver's figures
        (reserved: physical bytes it holds for this allocator), read by the allocator
        (:meth:`Allocator.stats_of`)."""
        return self.allocator.stats_of(self.counters)

    def stats(self) -> dict:
        """``torch.cuda.memory_stats()``-style statistics (:func:`~vmstoolkit.integrations.bridge.torch_stats`)."""
        return torch_stats(self.allocator_stats())

    def record_stream(self, ptr: int, stream: int) -> None:
        """``Tensor.record_stream``: the block is not reused before ``stream``'s work queued up to its free."""
        self.allocator.record_block(ptr, stream)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: the peaks start again from the current figures."""
        with self.allocator.slow_lock:
            self.allocator.reset_peaks_of(self.counters)

    def reset_accumulated(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats``: the totals and the out-of-memory count
        zeroed (``failed_mallocs`` is the bridge's count, kept, as :class:`AllocatorBridge` keeps it)."""
        with self.allocator.slow_lock:
            self.allocator.reset_totals_of(self.counters)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: every cached chunk no live block uses given back."""
        pa = self.allocator
        with pa.slow_lock, pa.driver.bound():
            self.g[H.G_BUSY] += 1
            try:
                pa.empty_cache()
            finally:
                self.g[H.G_BUSY] -= 1


class NativeHook(HookBase):
    """The compiled entry points and the devices they serve. ``driver_factory(device)`` makes
    each device's driver (the real one by default; the simulated one in tests)."""

    _active: "NativeHook | None" = None  # the table serves one hook per process
    runs_python = False  # compiled entry points; their rare slow paths call Python (see module doc)

    def __init__(self, driver_factory, **options) -> None:
        if NativeHook._active is not None:
            raise IntegrationError("a native vmstoolkit hook already owns this process's device table; close() it first")
        super().__init__()
        self._driver_factory = driver_factory
        self._options = options
        self.devices: dict[int, NativeDevice] = {}
        self.limits: dict[int, tuple[int, str]] = {}  # device -> (bytes, what set it), while a memory fraction is set
        self._make_lock = threading.Lock()
        _SERVED[0] = self  # the slow paths' callbacks call this hook's methods
        (self.slow_alloc_fn, self.slow_map_fn, self.slow_free_fn, self.slow_wait_fn,
         self.alloc_cfunc, self.free_cfunc) = _compiled()
        NativeHook._active = self

    allocator_name = PagedAllocator.name

    @property
    def alloc_ptr(self) -> int:
        return self.alloc_cfunc.address

    @property
    def free_ptr(self) -> int:
        return self.free_cfunc.address

    def close(self) -> None:
        """Give every device's memory back, blocks still live included (only when PyTorch no
        longer uses the hook: tests and replays)."""
        for dev, nd in self.devices.items():
            TABLE[dev * ROW + R_READY] = 0
            nd.allocator.free_untracked()  # the hook's blocks are not in the Python bookkeeping
            nd.allocator.close()
            nd.allocator.driver.close()
        self.devices.clear()
        NativeHook._active = None

    # -- the integration's handle interface (:class:`~vmstoolkit.integrations.torch.HookBase`)
    def bridge(self, device: int) -> NativeDevice:
        return self.device(device)

    def devices_in_use(self) -> list[int]:
        return list(self.devices)

    def _history_changed(self, enabled: bool) -> None:
        # while recording, the compiled fast paths defer to Python, which logs every call
        for nd in self.devices.values():
            nd.g[H.G_BUSY] += 1 if enabled else -1

    def _apply_limit(self, device: int, limit: int | None, why: str) -> None:
        # while a limit is set, the compiled fast paths defer to Python, which checks it
        nd = self.device(device)
        had = device in self.limits
        if limit is None:
            self.limits.pop(device, None)
        else:
            self.limits[device] = (limit, why)
        if had != (limit is not None):
            with nd.allocator.slow_lock:
                nd.g[H.G_BUSY] += 1 if limit is not None else -1

    def pool_upstream(self, device: int) -> "_NativeUpstream":
        return _NativeUpstream(self, self.device(device), device)

    # -- devices -----------------------------------------------------------------------------
    def device(self, dev: int) -> NativeDevice:
        def make() -> NativeDevice:
            if not 0 <= dev < MAX_DEVICES:
                raise IntegrationError(f"device {dev} is outside 0..{MAX_DEVICES - 1}, the devices the compiled hook serves")
            pa = PagedAllocator(self._driver_factory(dev), **self._options)
            pa.reserve_ranges()
            pa.on_arrays_changed = lambda: _publish(dev, pa)  # block records grown: new addresses
            nd = NativeDevice(pa)
            if self._recording:
                nd.g[H.G_BUSY] += 1
            if dev in self.limits:
                nd.g[H.G_BUSY] += 1
            _publish(dev, pa)
            return nd

        return per_device(self.devices, self._make_lock, dev, make)

    # -- the slow paths (called from the cfuncs, holding the GIL) -----------------------------
    @contextmanager
    def _working(self, nd: NativeDevice, size: int, dev: int):
        """The slow path's frame: the allocator's lock, the device marked busy (fast paths defer),
        the time counted; an exception is recorded (and reported on standard error when no shim
        raises it as torch.OutOfMemoryError)."""
        t0 = time.perf_counter()
        try:
            with nd.allocator.slow_lock, nd.allocator.driver.bound():  # bound: the calling thread may have no context
                nd.g[H.G_BUSY] += 1
                try:
                    yield
                finally:
                    nd.g[H.G_BUSY] -= 1
        except Exception as e:
            nd.last_error = self.last_error = e
            nd.failed_mallocs += 1
            if isinstance(e, OutOfMemoryError):
                nd.allocator.note_oom()  # as Allocator.allocate counts it
            if not self.raises:
                report_failed_malloc(size, dev, e)
        finally:
            nd.seconds += time.perf_counter() - t0

    def _slow_alloc(self, size: int, dev: int, stream: int) -> int:
        try:
            nd = self.device(dev)
        except Exception as e:
            self.last_error = e
            if not self.raises:
                report_failed_malloc(size, dev, e)
            return 0
        with self._working(nd, size, dev):
            self._check_limit(nd, size, dev)
            addr = nd.allocator.alloc_block(size, stream)
            count_alloc(nd.counters, size)
            if self._recording:
                self.history.record("alloc", dev, addr, size, stream)
            return addr
        return 0

    def _check_limit(self, nd: NativeDevice, size: int, dev: int) -> None:
        lim = self.limits.get(dev)
        if lim is not None and int(nd.counters[C_ALLOCATED]) + size > lim[0]:
            raise past_limit(self.allocator_name, size, int(nd.counters[C_ALLOCATED]), lim[0], nd.allocator.driver, lim[1])

    def _slow_map(self, dev: int, which: int, start: int, n: int, size: int, stream: int) -> int:
        nd = self.devices[dev]
        pa = nd.allocator
        heap = pa.large if which == 0 else pa.small
        with self._working(nd, size, dev):
            pa.map_block(heap, start, n, size)  # frees the block again on failure
            pa.order_after(heap, start, n, stream)
            count_alloc(nd.counters, size)
            return 1
        return 0

    def _slow_wait(self, dev: int, stream: int, mask: int) -> None:
        nd = self.devices[dev]
        with self._working(nd, 0, dev):
            nd.allocator.wait_for(stream, mask)

    def _slow_free(self, ptr: int, size: int, dev: int, stream: int) -> None:
        nd = self.devices.get(dev)
        if nd is None:
            return
        try:
            pa = nd.allocator
            if pa.free_block(ptr, pa.slot_bit(stream)):
                count_free(nd.counters, size)
                if self._recording:
                    self.history.record("free_completed", dev, ptr, size, stream)
            else:
                nd.g[G_BAD_FREES] += 1
        except Exception as e:
            nd.last_error = self.last_error = e


class _NativeUpstream:
    """A device of the compiled hook as the private pools' upstream: the slow path's calls, with
    the hook's counters and its history, errors raised (the pool callbacks catch them)."""

    def __init__(self, hook: NativeHook, nd: NativeDevice, dev: int) -> None:
        self.hook, self.nd, self.dev = hook, nd, dev
        self.sizes: dict[int, int] = {}  # address -> size of the blocks it handed out

    def allocate(self, size: int, stream: int = 0) -> int:
        nd, pa = self.nd, self.nd.allocator
        with pa.slow_lock, pa.driver.bound():
            nd.g[H.G_BUSY] += 1
            try:
                self.hook._check_limit(nd, size, self.dev)
                addr = pa.alloc_block(size, stream)
            except Exception as e:
                nd.last_error = e
                nd.failed_mallocs += 1
                if isinstance(e, OutOfMemoryError):
                    pa.note_oom()
                raise
            finally:
                nd.g[H.G_BUSY] -= 1
            count_alloc(nd.counters, size)
        self.sizes[addr] = size
        if self.hook._recording:
            self.hook.history.record("alloc", self.dev, addr, size, stream)
        return addr

    def free(self, addr: int, stream: int | None = None) -> None:
        self.hook._slow_free(addr, self.sizes.pop(addr, 0), self.dev, stream or 0)


def _publish(dev: int, pa: PagedAllocator) -> None:
    """Write ``pa``'s array addresses into the device's row of :data:`TABLE` (ready last)."""
    row = dev * ROW
    TABLE[row + R_G] = pa.g.ctypes.data
    TABLE[row + R_G_LEN] = pa.g.shape[0]
    TABLE[row + R_LARGE_BASE], TABLE[row + R_LARGE_BYTES] = pa.large.base, pa.large.nbytes
    TABLE[row + R_SMALL_BASE], TABLE[row + R_SMALL_BYTES] = pa.small.base, pa.small.nbytes
    TABLE[row + R_LARGE_SHIFT], TABLE[row + R_SMALL_SHIFT] = pa.large.unit_shift, pa.small.unit_shift
    TABLE[row + R_SLOTS] = pa.stream_slots.ctypes.data
    for h, heap in enumerate((pa.large, pa.small)):
        for i, a in enumerate(heap.arrays()):
            TABLE[row + R_HEAPS + 2 * (h * N_HEAP_ARRAYS + i)] = a.ctypes.data
            TABLE[row + R_HEAPS + 2 * (h * N_HEAP_ARRAYS + i) + 1] = a.shape[0]
    TABLE[row + R_READY] = 1


_SERVED: list = [None]  # the hook whose methods the slow-path callbacks call: the newest one
_COMPILED: tuple | None = None


def _compiled() -> tuple:
    """The slow-path callbacks and the two cfuncs, compiled once per process (about 2.5 s of CPU
    each time before: every hook compiled its own). One hook owns the table at a time, so the
    callbacks call the newest hook's methods; the cfuncs read the same table for every hook."""
    global _COMPILED
    if _COMPILED is None:
        fns = (SLOW_ALLOC_FN(lambda size, dev, stream: _SERVED[0]._slow_alloc(size, dev, stream)),
               SLOW_MAP_FN(lambda dev, which, start, n, size, stream:
                           _SERVED[0]._slow_map(dev, which, start, n, size, stream)),
               SLOW_FREE_FN(lambda ptr, size, dev, stream: _SERVED[0]._slow_free(ptr, size, dev, stream)),
               SLOW_WAIT_FN(lambda dev, stream, mask: _SERVED[0]._slow_wait(dev, stream, mask)))
        _COMPILED = (*fns, *_compile(*fns))
    return _COMPILED


def _compile(slow_alloc, slow_map, slow_free, slow_wait):
    """The two cfuncs, bound to this process's table and the given slow-path callbacks."""
    from numba import carray, cfunc, types

    p64, p32, p8, pu64 = pointer_to(types.int64), pointer_to(types.int32), pointer_to(types.int8), pointer_to(types.uint64)
    table_addr = TABLE.ctypes.data
    table_len = TABLE.shape[0]

    @njit(inline="always")
    def heap_views(t, b):
        return (carray(p64(t[b]), t[b + 1]), carray(p64(t[b + 2]), t[b + 3]), carray(p64(t[b + 4]), t[b + 5]),
                carray(p8(t[b + 6]), t[b + 7]), carray(p32(t[b + 8]), t[b + 9]), carray(p32(t[b + 10]), t[b + 11]),
                carray(p32(t[b + 12]), t[b + 13]), carray(p32(t[b + 14]), t[b + 15]), carray(p32(t[b + 16]), t[b + 17]),
                carray(p32(t[b + 18]), t[b + 19]), carray(p32(t[b + 20]), t[b + 21]), carray(pu64(t[b + 22]), t[b + 23]),
                carray(p32(t[b + 24]), t[b + 25]), carray(p32(t[b + 26]), t[b + 27]), carray(p32(t[b + 28]), t[b + 29]),
                carray(p64(t[b + 30]), t[b + 31]), carray(p64(t[b + 32]), t[b + 33]))

    @njit(inline="always")
    def slot_bit(t, row, g, stream):
        """The stream's tag bit; 0 for a stream without a slot yet (the slow path gives it one)."""
        slots = carray(p64(t[row + R_SLOTS]), MAX_SLOTS)
        k = g[G_NSLOTS]
        for i in range(k):
            if slots[i] == stream:
                return np.int64(1) << i
        return np.int64(0)

    heap_alloc, heap_free, take_tags = H.heap_alloc, H.heap_free, H.take_tags
    counted_alloc, counted_free = count_alloc, count_free
    c0, c1 = G_COUNTERS, G_COUNTERS + len(Allocator.COUNTERS)
    release = _gil_release
    small_size = SMALL_SIZE
    overflow = np.int64(OVERFLOW_BIT)

    # cudaStream_t arrives as a 64-bit integer (the same register as a pointer on x86-64 and arm64)
    @cfunc(types.uint64(types.uint64, types.int32, types.uint64))  # void* alloc(size_t, int, cudaStream_t)
    def alloc(size, device, stream):
        if size == 0:
            return 0
        st = take_gil()  # released below
        t = carray(p64(table_addr), table_len)
        row = device * ROW
        s = np.int64(stream)
        result = 0
        if 0 <= device < MAX_DEVICES and t[row + R_READY] == 1:
            g = carray(p64(t[row + R_G]), t[row + R_G_LEN])
            bit = slot_bit(t, row, g, s)
            # sizes the heap cannot hold (2**63 and up included) go to Python, which says OOM
            if g[H.G_BUSY] == 0 and bit != 0 and size <= np.uint64(t[row + R_LARGE_BYTES]):
                small = size <= small_size
                shift = t[row + R_SMALL_SHIFT] if small else t[row + R_LARGE_SHIFT]
                b = row + R_HEAPS + (2 * N_HEAP_ARRAYS if small else 0)
                n = (np.int64(size) + (np.int64(1) << shift) - 1) >> shift
                views = heap_views(t, b)
                start, missing = heap_alloc(*views, g, n)
                if start >= 0:
                    if missing == 0:
                        counted_alloc(g[c0:c1], np.int64(size))
                        w = take_tags(views[0], views[12], views[13], views[16], start, n, 0 if bit == overflow else bit)
                        if w != 0:  # chunks another stream's queued work may use: order after it
                            slow_wait(device, s, w)
                        ok = True
                    else:
                        ok = slow_map(device, 1 if small else 0, start, n, size, s) == 1
                    if ok:
                        base = t[row + R_SMALL_BASE] if small else t[row + R_LARGE_BASE]
                        result = base + (start << shift)
                    release(st)
                    return result
        result = slow_alloc(size, device, s)
        release(st)
        return result

    @cfunc(types.void(types.uint64, types.uint64, types.int32, types.uint64))  # free(void*, size_t, int, cudaStream_t)
    def free(ptr, size, device, stream):
        addr = np.int64(ptr)
        if addr == 0:
            return
        st = take_gil()
        t = carray(p64(table_addr), table_len)
        row = device * ROW
        s = np.int64(stream)
        done = False
        if 0 <= device < MAX_DEVICES and t[row + R_READY] == 1:
            g = carray(p64(t[row + R_G]), t[row + R_G_LEN])
            bit = slot_bit(t, row, g, s)
            if g[H.G_BUSY] == 0 and bit != 0:
                done = True
                k = -1
                for h in range(2):
                    base = t[row + (R_LARGE_BASE if h == 0 else R_SMALL_BASE)]
                    shift = t[row + (R_LARGE_SHIFT if h == 0 else R_SMALL_SHIFT)]
                    if base <= addr < base + t[row + (R_LARGE_BYTES if h == 0 else R_SMALL_BYTES)]:
                        if (addr - base) & ((np.int64(1) << shift) - 1) == 0:  # a block's start, not inside one
                            k = heap_free(*heap_views(t, row + R_HEAPS + 2 * N_HEAP_ARRAYS * h), g, (addr - base) >> shift, bit)
                if k > 0:
                    counted_free(g[c0:c1], np.int64(size))
                else:
                    g[G_BAD_FREES] += 1
        if not done:
            slow_free(addr, size, device, s)
        release(st)

    return alloc, free
