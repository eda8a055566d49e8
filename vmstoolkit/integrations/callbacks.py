"""Python callbacks called from threads Python did not start, made cheap.

A framework calls our ``ctypes`` callbacks from its own native threads: PyTorch's autograd
engine runs the backward pass (and so about half of all allocations and frees) on a device
thread of its own. For such a thread ``ctypes`` calls ``PyGILState_Ensure`` on entry, which
finds no Python thread state, *creates* one, and destroys it again on exit: every callback pays
for a thread state's birth and death, many times what the call itself costs from a Python
thread. ``benchmarks/callback_overhead.py`` measures it, and what the pins below save
(``docs/results.md#callback-overhead``).

:class:`ThreadStatePins` keeps one extra ``PyGILState_Ensure`` per native thread that calls in
(never released), so the thread keeps its state for its lifetime and later entries only take
the GIL: the same trick pybind11 plays for threads that call into Python repeatedly. The cost is
one Python thread state (a few hundred bytes) per such thread, held until the thread ends;
framework threads live as long as the process.

:func:`roundtrips_from_native_thread` drives a pair of C allocator entry points from a fresh
native thread (a Numba ``cfunc`` started with ``pthread_create``), as a framework would: for
tests and the benchmark.
"""

from __future__ import annotations

import ctypes
import threading

_ensure = ctypes.pythonapi.PyGILState_Ensure
_ensure.restype = ctypes.c_int
_ensure.argtypes = []


class ThreadStatePins:
    """Keeps the Python thread state of every thread that calls :meth:`pin`.

    Call :meth:`pin` first thing in a callback. Threads Python started already keep their state;
    for them the pin only raises a counter, harmlessly.
    """

    def __init__(self) -> None:
        self.pinned: set[int] = set()  # thread idents (an ident may be reused after a thread ends)

    def pin(self) -> None:
        """Runtime cost: one set lookup once the thread is pinned."""
        ident = threading.get_ident()
        if ident not in self.pinned:
            _ensure()  # never released: this thread's state now outlives the callback
            self.pinned.add(ident)


def roundtrips_from_native_thread(alloc_ptr: int, free_ptr: int, size: int, n: int) -> tuple[int, float]:
    """Call ``alloc(size, 0, NULL)`` then ``free(ptr, size, 0, NULL)`` ``n`` times from a new
    native thread (PyTorch's callback signatures). Returns (non-null pointers, seconds)."""
    import time

    import numba
    from numba import cfunc, types

    from vmstoolkit.integrations.abi import ALLOC_FN, FREE_FN

    alloc = ALLOC_FN(alloc_ptr)
    free = FREE_FN(free_ptr)

    @cfunc(types.voidptr(types.CPointer(types.int64)))
    def body(args):  # args: [n, size, non-null count (out)]
        ok = 0
        nul = numba.uint64(0)
        for _ in range(args[0]):
            p = alloc(numba.uint64(args[1]), numba.int32(0), nul)
            if p != 0:
                ok += 1
            free(p, numba.uint64(args[1]), numba.int32(0), nul)
        args[2] = ok
        return nul

    libc = ctypes.CDLL(None)
    buf = (ctypes.c_int64 * 3)(n, size, 0)
    tid = ctypes.c_ulong()
    t0 = time.perf_counter()
    rc = libc.pthread_create(ctypes.byref(tid), None, ctypes.c_void_p(body.address), buf)
    if rc != 0:
        raise OSError(rc, "pthread_create failed")
    libc.pthread_join(tid, None)
    return buf[2], time.perf_counter() - t0
