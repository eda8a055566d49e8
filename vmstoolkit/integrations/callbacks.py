"""Python callbacks called from threads Python did not start, made cheap.

A framework calls our ``ctypes`` callbacks from its own native threads: PyTorch's autograd
engine runs the backward pass (and so about half of all allocations and frees) on a device
thread of its own. For such a thread ``ctypes`` calls ``PyGILState_Ensure`` on entry, which
finds no Python thread state, *creates* one, and destroys it again on exit: every callback pays
for a thread state's birth and death. ``benchmarks/callback_overhead.py`` measures it: 12-13 us
per call against 0.3 us from a Python thread on the 2-core CPU machine
(``experiments/results/callback_overhead/``).

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

from vmstoolkit._thread_states import ThreadStatePins  # noqa: F401 (moved below exec/ and integrations/; re-exported)


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
