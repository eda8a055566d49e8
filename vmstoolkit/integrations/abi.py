"""The C signatures PyTorch's allocator hook and vmstoolkit's shim call (one place for both the
``ctypes`` callbacks and the compiled entry points, and for tests that call them)."""

from __future__ import annotations

import ctypes

# void* alloc(size_t size, int device, cudaStream_t stream)
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# void free(void* ptr, size_t size, int device, cudaStream_t stream)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# the shim's cold entry points (csrc/torch_shim.cpp)
RECORD_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)  # ptr, device, its stream, user
STATS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)  # device, out, n
RESET_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int)  # device, 0: peaks, 1: totals
EMPTY_FN = ctypes.CFUNCTYPE(None)
ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)  # device, request, buffer, size
# private pools (CUDA graphs, cudagraph trees, MemPool), the memory fraction
POOL_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                                 ctypes.c_uint64)  # size, device, stream, pool id
POOL_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                                ctypes.c_uint64)  # ptr, size, device, stream, pool id
POOL_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_size_t)  # device, pool id, event, ptr, size
POOL_EVENTS = ("use", "release", "take_back", "use_count")  # the shim's enum PoolEvent, in order
SET_FRACTION_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_double)  # device, fraction -> 0
GET_FRACTION_FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int)  # device -> fraction
