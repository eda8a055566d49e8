"""Numba's scalar types called as casts (``int32(x)``, ``float32(x)``) without the import and ABC
checks that each such call pays (tests only).

Under the CUDA simulator a kernel is plain Python, and every ``int32(...)`` in it goes through
``numba.core.types.abstract.Type.__call__``: a ``from numba.core.typing import signature`` on
every call (``_handle_fromlist``), then ``isinstance(arg, Type)``, an ABC check. Profiled on the
fp32 GEMM's skinny-tile test (yappi, CPU clock) these took about 45% of the kernel threads' time.
:func:`install` puts a ``__call__`` in front of the stock one that answers a one-argument call on
a plain Python or numpy scalar with the type's own ``cast_python_value`` (for the integer and
real types, the numpy constructor that it calls), exactly what the stock method returns for it; every other call (a signature: ``int32(int32, float32)``, a numba type or
anything else as the argument) goes to the stock method. Inside a simulated launch the kernel's
module does not even go through that: its ``float32``, ``uint64``... are the numpy constructors
for the launch (:func:`_swap_scalars_in_launched_modules`). Without the expected internals
nothing is replaced.
"""

from __future__ import annotations

import numpy as np

_ABSENT = object()  # by_id.get default that no global is
_PLAIN = frozenset({int, float, bool, *(np.dtype(c).type for c in "bBhHiIlLqQefdg?")})


def install() -> bool:
    """Put the fast path in front of ``Type.__call__``; True if it is there (idempotent)."""
    try:
        from numba.core.types import abstract
    except ImportError:
        return False
    t = getattr(abstract, "Type", None)
    if t is None or not hasattr(t, "cast_python_value"):
        return False
    if getattr(t, "_vmstoolkit_casts", False):
        return True
    stock = t.__call__
    from numba.core import types
    from numba.core.types import scalars

    # The numpy constructor that the stock cast_python_value calls, for the integer and real types
    # whose cast is the stock one (``getattr(np, self.name)(value)``)
    # Keyed by the type's id, not the type: a numba type hashes through a Python-level __hash__
    # and its ``key`` property, which on the GEMM tests' millions of casts cost more than the
    # rest of the call. The types are interned and held here (``kept``), so their ids stay theirs.
    kept = [ty for ty in (*types.integer_domain, *types.real_domain)
            if type(ty).cast_python_value in (scalars.Integer.cast_python_value, scalars.Float.cast_python_value)]
    direct = {id(ty): getattr(np, ty.name) for ty in kept}
    direct_get, plain = direct.get, _PLAIN

    def __call__(self, *args):
        if len(args) == 1 and type(args[0]) in plain:
            f = direct_get(id(self))
            return f(args[0]) if f is not None else self.cast_python_value(args[0])
        return stock(self, *args)

    __call__._vmstoolkit_kept = kept

    t.__call__ = __call__
    t._vmstoolkit_casts, t._vmstoolkit_stock_call = True, stock
    _swap_scalars_in_launched_modules(kept, direct)
    return True


def _swap_scalars_in_launched_modules(kept: list, direct: dict) -> bool:
    """While a module's ``cuda`` is swapped for the simulated one (a launch of one of its kernels,
    a call of one of its device functions), its globals bound to the integer and real types above
    (``from numba import float32, uint64``) are swapped too, for the numpy constructors that those
    types' casts return from: ``float32(x)`` in a kernel is then ``np.float32(x)`` with no Python
    frame between, the value that the stock cast returns for any argument but a numba type (a
    signature, which no kernel body builds). Everything else of the stock
    ``kernelapi.swapped_cuda_module`` is kept: the per-module lock and reference count, the
    first entry swapping and the last exit restoring. Without those internals nothing is
    replaced."""
    try:
        from numba.cuda.simulator import kernel as K
        from numba.cuda.simulator import kernelapi as KA
    except ImportError:
        return False
    needed = ("_locks_register_lock", "_globals_locks", "_swap_refcount", "_swap_orig")
    if not all(hasattr(KA, n) for n in needed) or getattr(K, "swapped_cuda_module", None) is not KA.swapped_cuda_module:
        return False
    from contextlib import contextmanager

    by_id = {id(ty): ty for ty in kept}

    @contextmanager
    def swapped_cuda_module(fn, fake_cuda_module):
        from numba import cuda

        fn_globs = fn.__globals__
        gid = id(fn_globs)
        with KA._locks_register_lock:
            lock = KA._globals_locks[gid]
        with lock:
            if KA._swap_refcount[gid] == 0:
                orig = {k: v for k, v in fn_globs.items() if v is cuda or by_id.get(id(v), _ABSENT) is v}
                KA._swap_orig[gid] = orig
                for k, v in orig.items():
                    fn_globs[k] = fake_cuda_module if v is cuda else direct[id(v)]
            KA._swap_refcount[gid] += 1
        try:
            yield
        finally:
            with lock:
                KA._swap_refcount[gid] -= 1
                if KA._swap_refcount[gid] == 0:
                    fn_globs.update(KA._swap_orig.pop(gid))
                    del KA._swap_refcount[gid]

    swapped_cuda_module._vmstoolkit_stock = KA.swapped_cuda_module
    K.swapped_cuda_module = swapped_cuda_module
    return True
