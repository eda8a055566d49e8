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
against ``hook-async-gil`` costs the heap (and anything the GPU minds about its mappings).
``train_llama_gpu.py`` runs them as modes.

The entry points are Numba ``cfunc``s that call the driver through its function addresses,
compiled in; tests compile them against stand-in C functions instead of the driver's.
"""

from __future__ import annotations

import ctypes

from numba import cfunc, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from llvmlite import ir

RELEASE_THRESHOLD = 2**64 - 1  # keep freed memory in the pool across synchronizations, as PyTorch does


def _compile(alloc_addr: int, free_addr: int, take_gil: bool):
    """``alloc(size, device, stream)`` and ``free(ptr, size, device, stream)`` cfuncs calling
    ``int alloc_fn(uint64_t *out, size_t size, void *stream)`` and ``int free_fn(uint64_t ptr,
    void *stream)`` at the given addresses (``cuMemAllocAsync`` and ``cuMemFreeAsync``)."""
    from vmstoolkit.integrations.native_torch import _gil_ensure, _gil_release, _gil_this_state

    i32, i64 = ir.IntType(32), ir.IntType(64)

    @intrinsic
    def call_alloc(typingctx, size, stream):
        sig = types.uint64(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(i32, [i64.as_pointer(), i64, ir.IntType(8).as_pointer()])
            fn = builder.inttoptr(ir.Constant(i64, alloc_addr), fnty.as_pointer())
            slot = cgutils.alloca_once(builder, i64)
            builder.store(ir.Constant(i64, 0), slot)
            rc = builder.call(fn, [slot, args[0], args[1]])
            return builder.select(builder.icmp_signed("==", rc, ir.Constant(i32, 0)), builder.load(slot),
                                  ir.Constant(i64, 0))

        return sig, codegen

    @intrinsic
    def call_free(typingctx, ptr, stream):
        sig = types.int32(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(i32, [i64, ir.IntType(8).as_pointer()])
            fn = builder.inttoptr(ir.Constant(i64, free_addr), fnty.as_pointer())
            return builder.call(fn, [args[0], args[1]])

        return sig, codegen

    this_state, ensure, release = _gil_this_state, _gil_ensure, _gil_release
    gil = take_gil

    @cfunc(types.uint64(types.uint64, types.int32, types.voidptr))
    def alloc(size, device, stream):
        if size == 0:
            return 0
        if gil:
            fresh = this_state() == 0
            st = ensure()
            if fresh:
                ensure()
            ptr = call_alloc(size, stream)
            release(st)
            return ptr
        return call_alloc(size, stream)

    @cfunc(types.void(types.uint64, types.uint64, types.int32, types.voidptr))
    def free(ptr, size, device, stream):
        if ptr == 0:
            return
        if gil:
            fresh = this_state() == 0
            st = ensure()
            if fresh:
                ensure()
            call_free(ptr, stream)
            release(st)
            return
        call_free(ptr, stream)

    return alloc, free


class DriverPool:
    """The driver's default memory pool of ``device``: its high-water marks; with ``keep``, it
    keeps freed memory across synchronizations (as PyTorch's ``cudaMallocAsync`` backend sets it)."""

    def __init__(self, device: int = 0, keep: bool = False) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        (err,) = cu.cuInit(0)
        self._check(err, "cuInit")
        err, dev = cu.cuDeviceGet(device)
        self._check(err, "cuDeviceGet")
        err, self.pool = cu.cuDeviceGetDefaultMemPool(dev)
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
        lib = ctypes.CDLL("libcuda.so.1")
        addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        self.alloc_cfunc, self.free_cfunc = _compile(addr("cuMemAllocAsync"), addr("cuMemFreeAsync"), take_gil)

    def install(self) -> "AsyncPoolHook":
        import torch

        self._torch_allocator = torch._C._cuda_customAllocator(self.alloc_cfunc.address, self.free_cfunc.address)
        torch._C._cuda_changeCurrentAllocator(self._torch_allocator)
        return self
