"""Drive allocator entry points as a framework would, for tests and benchmarks.

:func:`roundtrips_from_native_thread` calls a pair of C allocator entry points (PyTorch's
signatures) from a fresh native thread, a Numba ``cfunc`` started with ``pthread_create``, the
way PyTorch's autograd threads call them (:mod:`vmstoolkit.integrations.callbacks` says why
that thread matters). ``benchmarks/callback_overhead.py`` times it; the integration tests use
it to check that the entry points survive such threads.
"""

from __future__ import annotations

import ctypes
import os

from vmstoolkit.errors import IntegrationError


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
        raise IntegrationError(f"pthread_create failed with error {rc} ({os.strerror(rc)})")
    libc.pthread_join(tid, None)
    return buf[2], time.perf_counter() - t0
