"""The Numba CUDA simulator's in-kernel array indexing without two Python calls per element
(tests only).

In a simulated kernel a device array is a ``FakeWithinKernelCUDAArray`` around a
``FakeCUDAArray`` around the numpy array, and ``a[i, j]`` goes through both wrappers'
``__getitem__`` and a ``__wrap_if_fake`` (an ``isinstance``) before reaching numpy: profiled on
the fp32 GEMM tests, about a tenth of the kernel threads' time. :func:`install` gives the outer
wrapper an ``__getitem__``/``__setitem__`` that index the numpy array directly when the inner one
is a plain ``FakeCUDAArray``: the same element back (a numpy scalar as is; a sub-array or record
wrapped as the stock chain wraps it, with the inner array's stream). Anything else goes to the
stock methods. Without the expected internals nothing is replaced.
"""

from __future__ import annotations

import numpy as np


def install() -> bool:
    """Put the direct indexing in front of ``FakeWithinKernelCUDAArray``'s; True if it is there."""
    try:
        from numba.cuda.simulator.cudadrv import devicearray as D
    except ImportError:
        return False
    outer, inner = getattr(D, "FakeWithinKernelCUDAArray", None), getattr(D, "FakeCUDAArray", None)
    if outer is None or inner is None or not hasattr(outer, "__getitem__"):
        return False
    if getattr(outer, "_vmstoolkit_arrays", False):
        return True
    stock_get, stock_set = outer.__getitem__, outer.__setitem__
    wrapped = (np.ndarray, np.void)  # what the stock FakeCUDAArray.__getitem__ wraps

    def __getitem__(self, idx):
        item = self.__dict__["_item"]
        if type(item) is not inner:
            return stock_get(self, idx)
        ret = item._ary[idx]
        if type(ret) not in wrapped:
            return ret
        return outer(inner(ret, stream=item.stream))

    def __setitem__(self, idx, val):
        item = self.__dict__["_item"]
        if type(item) is not inner:
            return stock_set(self, idx, val)
        item._ary[idx] = val

    outer.__getitem__, outer.__setitem__ = __getitem__, __setitem__
    outer._vmstoolkit_arrays = True
    outer._vmstoolkit_stock = (stock_get, stock_set)
    return True
