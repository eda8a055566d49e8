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
        from numba import cuda
        from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
    except ImportError as e:
        raise VmsError(f"numba-cuda is not usable here ({e})") from None
    make_allocator(allocator, make_driver("sim"), **options)  # validate name and options early

    class VmsNumbaMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Numba EMM plugin over a vmstoolkit allocator (one per context/device)."""

        allocator_name = allocator

        def initialize(self):
            if getattr(self, "bridge", None) is None:
                dev = self.context.device.id
                self.bridge = AllocatorBridge(make_allocator(allocator, make_driver("cuda", device=dev), **options))

        def memalloc(self, size):
            self.initialize()
            ptr = self.bridge.malloc(size)
            if not ptr:
                raise cuda.cudadrv.driver.CudaAPIError(2, f"vmstoolkit {allocator}: cannot allocate {size} bytes ({self.bridge.last_error})")
            bridge = self.bridge
            return MemoryPointer(weakref.proxy(self.context), ctypes.c_void_p(ptr), size,
                                 finalizer=lambda: bridge.free(ptr))

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
