"""The Numba CUDA simulator's ``cuda.shared.array`` without a traceback per call (tests only).

The simulator keys a launch's static shared arrays by the (file, line) of the call, and finds
that line with ``traceback.extract_stack``: a ``FrameSummary`` for every frame of the calling
thread, each looked up in ``linecache`` (an ``os.stat`` of its file). Every thread of every block
makes that call once per shared array, so profiled on the fp32 GEMM's skinny-tile tests the
``stat`` calls alone were about a third of the kernel threads' CPU time. :func:`install` reads
the caller's (file, line) from its frame instead (``sys._getframe(1)``: the same two values that
``extract_stack(...)[-2][0:2]`` gives) and converts the dtype only when the array is made; the
same arrays, keyed the same way, come back. Dynamic shared memory (``shape == 0``) and the
``alignment`` refusal go to the stock method. Without the expected internals nothing is replaced.
"""

from __future__ import annotations

import sys

import numpy as np


def install() -> bool:
    """Put the frame lookup in front of ``FakeCUDAShared.array``; True if it is there."""
    try:
        from numba.cuda.simulator import kernelapi as K
    except ImportError:
        return False
    fs = getattr(K, "FakeCUDAShared", None)
    if fs is None or not hasattr(fs, "array") or not hasattr(K, "numpy_support"):
        return False
    if getattr(fs, "_vmstoolkit_shared", False):
        return True
    stock = fs.array
    Type, as_dtype = K.types.Type, K.numpy_support.as_dtype
    getframe = sys._getframe

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # the stock checks, in the stock order of effect
            return stock(self, shape, dtype, alignment)
        f = getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations.setdefault(
                caller, np.empty(shape, as_dtype(dtype) if isinstance(dtype, Type) else dtype))
        return res

    fs.array = array
    fs._vmstoolkit_shared, fs._vmstoolkit_stock_array = True, stock
    return True
