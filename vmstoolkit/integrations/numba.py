"""vmstoolkit allocators behind Numba's device arrays: an External Memory Management plugin.

    import vmstoolkit.integrations.numba as vn
    handle = vn.install("vms")   # before Numba's first CUDA allocation
    d = numba.cuda.to_device(x)  # served by the vms pools
    handle.stats()               # the current device's statistics

(:func:`use_with_numba` is the same without the handle: it returns the plugin class.) Numba makes
a context's memory manager when it makes the context, so the plugin serves the contexts made
after :func:`install`, and there is no uninstall.

Numba's CUDA simulator has no EMM machinery (no contexts, no ``HostOnlyCUDAMemoryManager``):
there the plugin cannot exist and :func:`use_with_numba` says so.
"""

from __future__ import annotations

import ctypes
import os
import weakref

from vmstoolkit.errors import VmsError
from vmstoolkit.integrations import IntegrationHandle
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


class NumbaHandle(IntegrationHandle):
    """What :func:`install` returns: the plugin class and, per device, the allocator its
    context's memory manager made (``device=None``: Numba's current device). ``memory_stats``,
    ``max_memory_reserved`` and ``max_memory_allocated`` answer as for the PyTorch handle."""

    def __init__(self, name: str, manager) -> None:
        self.allocator_name = name
        self.manager = manager

    def bridge(self, device: int | None = None) -> AllocatorBridge:
        from numba import cuda

        ctx = cuda.current_context(device)
        mm = ctx.memory_manager
        if not isinstance(mm, self.manager):
            raise VmsError(f"device {ctx.device.id}'s Numba context was made before vmstoolkit {self.allocator_name!r} was "
                           "installed: Numba keeps the memory manager a context was made with")
        mm.initialize()
        return mm.bridge


def install(name: str = "vms", **options) -> NumbaHandle:
    """Make Numba allocate device memory through vmstoolkit's allocator ``name`` (before
    Numba's first CUDA allocation) and return the handle."""
    return NumbaHandle(name, use_with_numba(name, **options))
