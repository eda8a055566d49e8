"""vmstoolkit allocators behind Numba's device arrays: an External Memory Management plugin.

    from vmstoolkit.integrations.numba import use_with_numba
    use_with_numba("vms")        # before Numba's first CUDA allocation
    d = numba.cuda.to_device(x)  # served by the vms pools

Numba's CUDA simulator has no EMM machinery (no contexts, no ``HostOnlyCUDAMemoryManager``):
there the plugin cannot exist and :func:`use_with_numba` says so.
"""

from __future__ import annotations

import ctypes
import os
import weakref

from vmstoolkit.errors import VmsError
from vmstoolkit.integrations.bridge import AllocatorBridge
from vmstoolkit.pools import make_allocator, make_driver


def _simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def make_memory_manager(allocator: str = "vms", **options):
    """An EMM plugin class whose instances serve Numba allocations from ``allocator``."""
    if _simulator():
        raise VmsError("Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) has no external memory "
                       "management; the vmstoolkit EMM plugin needs a real GPU")
    try:
        from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
        from numba.cuda.cudadrv.driver import CudaAPIError
    except ImportError as e:
        raise VmsError(f"numba-cuda is not usable here ({e})") from None
    from vmstoolkit.pools.registry import check_allocator

    check_allocator(allocator, options)  # name and options, before anything is built

    class VmsNumbaMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Numba EMM plugin over a vmstoolkit allocator (one per context/device)."""

        allocator_name = allocator

        def initialize(self):
            if getattr(self, "bridge", None) is None:
                dev = self.context.device.id
                self.bridge = AllocatorBridge(make_allocator(allocator, make_driver("cuda", device=dev), **options))
                try:  # as Numba's own manager: bound the queue of deferred frees by the device size
                    from numba.cuda.cudadrv.driver import _SizeNotSet
                    if self.deallocations.memory_capacity == _SizeNotSet:
                        self.deallocations.memory_capacity = self.get_memory_info().total
                except ImportError:
                    pass

        def memalloc(self, size):
            self.initialize()
            bridge = self.bridge
            ptr = bridge.malloc(size)
            if not ptr and size:
                self.deallocations.clear()  # run the deferred frees, then try once more
                ptr = bridge.malloc(size)
            if not ptr and size:
                raise CudaAPIError(2, f"vmstoolkit {allocator}: cannot allocate {size} bytes ({bridge.last_error})")
            deallocations = self.deallocations

            def finalizer():
                # Deferred, as Numba defers cuMemFree: kernels queued on the memory may still
                # run; the queue is flushed at Numba's sync points and before a retry.
                deallocations.add_item(bridge.free, ptr, size)

            return MemoryPointer(weakref.proxy(self.context), ctypes.c_void_p(ptr), size, finalizer=finalizer)

        def get_memory_info(self):
            self.initialize()
            free, total = self.bridge.allocator.driver.mem_info()
            return MemoryInfo(free=free, total=total)

        def reset(self):
            super().reset()
            if getattr(self, "bridge", None) is not None:
                self.bridge.allocator.empty_cache()

        @property
        def interface_version(self):
            return 1

        def stats(self) -> dict:
            self.initialize()
            return self.bridge.stats()

    return VmsNumbaMemoryManager


def use_with_numba(allocator: str = "vms", **options):
    """Install the plugin: Numba's device arrays are then served by ``allocator``."""
    mm = make_memory_manager(allocator, **options)
    from numba import cuda

    cuda.set_memory_manager(mm)
    return mm
