"""Raw CUDA handles of Numba objects, for the places that call the driver directly (the CUDA
backend's host callbacks, copies and events; the kernels' planned launches). Imports nothing of
Numba or the driver, so either layer can use it without importing ``numba.cuda``."""

from __future__ import annotations

import ctypes


def raw_stream(stream) -> int:
    """The CUstream address of a numba stream (0 for the default stream, given as 0 or None),
    whichever binding numba runs on (ctypes ``c_void_p`` or cuda-bindings ``CUstream``, which has
    no ``.value``)."""
    if not stream:
        return 0
    h = stream.handle
    return (h.value or 0) if isinstance(h, ctypes.c_void_p) else int(h)  # c_void_p(0).value is None
