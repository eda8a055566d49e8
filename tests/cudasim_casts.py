"""Numba's scalar types called as casts (``int32(x)``, ``float32(x)``) without the import and ABC
checks that each such call pays (tests only).

Under the CUDA simulator a kernel is plain Python, and every ``int32(...)`` in it goes through
``numba.core.types.abstract.Type.__call__``: a ``from numba.core.typing import signature`` on
every call (``_handle_fromlist``), then ``isinstance(arg, Type)``, an ABC check. Profiled on the
fp32 GEMM's skinny-tile test (yappi, CPU clock) these took about 45% of the kernel threads' time.
:func:`install` puts a ``__call__`` in front of the stock one that answers a one-argument call on
a plain Python or numpy scalar with the type's own ``cast_python_value`` (for the integer and
real types, the numpy constructor that it calls), exactly what the stock method returns for it; every other call (a signature: ``int32(int32, float32)``, a numba type or
anything else as the argument) goes to the stock method. Without the expected internals
nothing is replaced.
"""

from __future__ import annotations

import numpy as np

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
    return True
