"""Reference allocators behind PyTorch's pluggable hook, to split a hooked allocator's cost.

PyTorch's hook (``torch._C._cuda_customAllocator``) adds its own work to every allocation and
free (a mutex and a hash map), and vmstoolkit's ``paged`` hook
(:mod:`vmstoolkit.integrations.native_torch`) takes the GIL around its heap. To see which costs
what inside a training step, these hooks serve every request from the CUDA driver's own
stream-ordered pool (``cuMemAllocAsync`` / ``cuMemFreeAsync``, the pool that PyTorch's
``backend:cudaMallocAsync`` uses natively), through the same hook:

- ``hook-async``: the driver's pool through the hook, nothing else;
- ``hook-async-gil``: the same, taking and releasing the GIL around each call exactly as the
  ``paged`` hook does (a thread's first call pins its Python thread state).

Against ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (the same pool, no hook),
``hook-async`` costs the hook; ``hook-async-gil`` against ``hook-async`` costs the GIL; ``paged``
against ``hook-async-gil`` costs the heap (and anything the GPU minds about its mappings), as
far as the GIL's cost does not depend on how long it is held (it does: see
``experiments/results/train-h200/`` run 19).
``train_llama_gpu.py`` runs them as modes.

The entry points are Numba ``cfunc``s that call the driver through its function addresses,
compiled in; tests compile them against stand-in C functions instead of the driver's.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from llvmlite import ir

from vmstoolkit.integrations.native_torch import _gil_release, pointer_to
from vmstoolkit.integrations.native_torch import take_gil as enter_gil  # the paged hook's own

RELEASE_THRESHOLD = 2**64 - 1  # keep freed memory in the pool across synchronizations, as PyTorch does
CUDA_ERROR_INVALID_CONTEXT = 201


def _compile(alloc_addr: int, free_addr: int, take_gil: bool, set_ctx_addr: int, ctx: int, errors: np.ndarray):
    """``alloc(size, device, stream)`` and ``free(ptr, size, device, stream)`` cfuncs calling
    ``int alloc_fn(uint64_t *out, size_t size, void *stream)`` and ``int free_fn(uint64_t ptr,
    void *stream)`` at the given addresses (``cuMemAllocAsync`` and ``cuMemFreeAsync``).

    PyTorch calls in from threads that may have no current context (its autograd threads: the
    runtime binds one lazily, the driver does not): on ``CUDA_ERROR_INVALID_CONTEXT`` a call makes
    ``ctx`` current with the function at ``set_ctx_addr`` (``cuCtxSetCurrent``) and retries once.
    Any other failure is counted in ``errors`` ([failures, last error code]) and gives the null pointer."""
    gil = take_gil  # a compile-time constant in the cfuncs
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)

    def call_retrying(builder, addr, fnty, args):
        """``rc = fn(*args)``; on an invalid context, ``set_ctx(ctx)`` and ``rc = fn(*args)``."""
        fn = builder.inttoptr(ir.Constant(i64, addr), fnty.as_pointer())
        rc = cgutils.alloca_once(builder, i32)
        builder.store(builder.call(fn, args), rc)
        with builder.if_then(builder.icmp_signed("==", builder.load(rc), ir.Constant(i32, CUDA_ERROR_INVALID_CONTEXT)),
                             likely=False):
            set_ctx = builder.inttoptr(ir.Constant(i64, set_ctx_addr), ir.FunctionType(i32, [i8p]).as_pointer())
            builder.call(set_ctx, [builder.inttoptr(ir.Constant(i64, ctx), i8p)])
            builder.store(builder.call(fn, args), rc)
        return builder.load(rc)

    @intrinsic
    def call_alloc(typingctx, size, stream):
        """The new pointer, or minus the error code (device pointers are below 2**63)."""
        sig = types.int64(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            out = cgutils.alloca_once(builder, i64)
            builder.store(ir.Constant(i64, 0), out)
            rc = call_retrying(builder, alloc_addr, ir.FunctionType(i32, [i64.as_pointer(), i64, i8p]),
                               [out, args[0], args[1]])
            return builder.select(builder.icmp_signed("==", rc, ir.Constant(i32, 0)), builder.load(out),
                                  builder.neg(builder.sext(rc, i64)))

        return sig, codegen

    @intrinsic
    def call_free(typingctx, ptr, stream):
        sig = types.int32(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            return call_retrying(builder, free_addr, ir.FunctionType(i32, [i64, i8p]), [args[0], args[1]])

        return sig, codegen

    pointer = pointer_to(types.uint64)
    release = _gil_release
    errors_addr = errors.ctypes.data

    @njit(inline="always")
    def failed(rc):
        e = carray(pointer(errors_addr), 2)
        e[0] += 1
        e[1] = rc

    @njit(inline="always")
    def serve(size, stream):
        r = call_alloc(size, stream)
        if r < 0:
            failed(-r)
            return np.uint64(0)
        return np.uint64(r)

    @njit(inline="always")
    def give_back(ptr, stream):
        rc = call_free(ptr, stream)
        if rc != 0:
            failed(rc)

    @cfunc(types.uint64(types.uint64, types.int32, types.voidptr))
    def alloc(size, device, stream):
        if size == 0:
            return 0
        if gil:
            st = enter_gil()
            ptr = serve(size, stream)
            release(st)
            return ptr
        return serve(size, stream)

    @cfunc(types.void(types.uint64, types.uint64, types.int32, types.voidptr))
    def free(ptr, size, device, stream):
        if ptr == 0:
            return
        if gil:
            st = enter_gil()
            give_back(ptr, stream)
            release(st)
            return
        give_back(ptr, stream)

    return alloc, free


class DriverPool:
    """The driver's default memory pool of ``device``: its high-water marks; with ``keep``, it
    keeps freed memory across synchronizations (as PyTorch's ``cudaMallocAsync`` backend sets it)."""

    def __init__(self, device: int = 0, keep: bool = False) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        (err,) = cu.cuInit(0)
        self._check(err, "cuInit")
        err, self.dev = cu.cuDeviceGet(device)
        self._check(err, "cuDeviceGet")
        err, self.pool = cu.cuDeviceGetDefaultMemPool(self.dev)
        self._check(err, "cuDeviceGetDefaultMemPool")
        if keep:
            (err,) = cu.cuMemPoolSetAttribute(self.pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                              cu.cuuint64_t(RELEASE_THRESHOLD))
            self._check(err, "cuMemPoolSetAttribute")

    def _check(self, err, what: str) -> None:
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {err}")

    def _attr(self, name: str) -> int:
        err, v = self._cu.cuMemPoolGetAttribute(self.pool, getattr(self._cu.CUmemPool_attribute, name))
        self._check(err, "cuMemPoolGetAttribute")
        return int(v)

    def max_memory_allocated(self) -> int:
        return self._attr("CU_MEMPOOL_ATTR_USED_MEM_HIGH")

    def max_memory_reserved(self) -> int:
        return self._attr("CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH")


class AsyncPoolHook(DriverPool):
    """The driver's default pool of ``device`` behind PyTorch's hook (:meth:`install` before the
    first CUDA allocation)."""

    def __init__(self, take_gil: bool, device: int = 0) -> None:
        super().__init__(device, keep=True)
        err, self.ctx = self._cu.cuDevicePrimaryCtxRetain(self.dev)  # PyTorch's context; held for the process
        self._check(err, "cuDevicePrimaryCtxRetain")
        lib = ctypes.CDLL("libcuda.so.1")
        addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        self.errors = np.zeros(2, np.uint64)  # [failed calls, last error code]
        self.alloc_cfunc, self.free_cfunc = _compile(addr("cuMemAllocAsync"), addr("cuMemFreeAsync"), take_gil,
                                                     addr("cuCtxSetCurrent"), int(self.ctx), self.errors)

    def install(self) -> "AsyncPoolHook":
        import torch

        self._torch_allocator = torch._C._cuda_customAllocator(self.alloc_cfunc.address, self.free_cfunc.address)
        torch._C._cuda_changeCurrentAllocator(self._torch_allocator)
        return self
