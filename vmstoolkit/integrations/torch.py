"""vmstoolkit allocators inside PyTorch, with no change to the user's model.

    import vmstoolkit.integrations.torch as vt
    handle = vt.install("vms")          # before the first CUDA tensor
    ... train as usual ...
    print(handle.memory_stats()["reserved_bytes.all.peak"])

PyTorch's pluggable-allocator hook takes two C function pointers; here they are ``ctypes``
callbacks into an :class:`~vmstoolkit.integrations.bridge.AllocatorBridge`, kept alive by the
returned handle (and a module-level reference), since PyTorch keeps only the raw pointers.
PyTorch calls them from its autograd device threads too; each such thread keeps a pinned Python
thread state (:mod:`vmstoolkit.integrations.callbacks`), else every call would create one.
The allocator must be installed before PyTorch's first CUDA allocation and cannot be swapped
back afterwards: that is PyTorch's rule, enforced by PyTorch.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

from vmstoolkit.errors import NoGPUError, VmsError
from vmstoolkit.integrations.bridge import AllocatorBridge, HandleStats, report_failed_malloc
from vmstoolkit.integrations.callbacks import ThreadStatePins
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.pools.driver import VMMDriver

# void* alloc(size_t size, int device, cudaStream_t stream)
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# void free(void* ptr, size_t size, int device, cudaStream_t stream)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

_INSTALLED: "TorchAllocatorHandle | None" = None


class TorchAllocatorHandle(HandleStats):
    """The callbacks, the per-device bridges and their statistics."""

    def __init__(self, allocator: str, driver_factory, options: dict) -> None:
        self.allocator_name = allocator
        self._driver_factory = driver_factory
        self._options = options
        self.bridges: dict[int, AllocatorBridge] = {}
        self.threads = ThreadStatePins()  # autograd's device threads call in: keep their states
        self.alloc_fn = ALLOC_FN(self._alloc)
        self.free_fn = FREE_FN(self._free)

    def bridge(self, device: int) -> AllocatorBridge:
        b = self.bridges.get(device)
        if b is None:
            driver = self._driver_factory(device)
            b = self.bridges[device] = AllocatorBridge(make_allocator(self.allocator_name, driver, **self._options))
        return b

    def _alloc(self, size, device, stream):
        try:
            self.threads.pin()
            return self.bridge(device).malloc(size) or None
        except Exception as e:  # never let an exception cross into C++
            self.last_error = e
            report_failed_malloc(size, device, e)
            return None

    def _free(self, ptr, size, device, stream):
        try:
            self.threads.pin()
            self.bridge(device).free(ptr or 0)
        except Exception as e:
            self.last_error = e

    @property
    def alloc_ptr(self) -> int:
        return ctypes.cast(self.alloc_fn, ctypes.c_void_p).value

    @property
    def free_ptr(self) -> int:
        return ctypes.cast(self.free_fn, ctypes.c_void_p).value

    def reset_peak_memory_stats(self, device: int = 0) -> None:
        b = self.bridge(device)
        with b._lock:
            b.allocator.reset_peak_stats()


def _import_torch():
    try:
        import torch
    except ImportError:
        raise VmsError("PyTorch is not installed: `pip install torch` to use vmstoolkit allocators inside PyTorch") from None
    if not torch.cuda.is_available():
        raise NoGPUError("PyTorch sees no CUDA GPU: the PyTorch integration needs one (replay works without: `vmstoolkit replay`)")
    return torch


def make_handle(allocator: str = "vms", driver_factory=None, **options) -> TorchAllocatorHandle:
    """The callbacks without installing them (``driver_factory(device) -> VMMDriver``)."""
    if driver_factory is None:
        def driver_factory(device: int) -> VMMDriver:
            return make_driver("cuda", device=device)
    make_allocator(allocator, make_driver("sim"), **options)  # validate name and options early
    return TorchAllocatorHandle(allocator, driver_factory, options)


def install(allocator: str = "vms", **options) -> TorchAllocatorHandle:
    """Make PyTorch allocate CUDA memory through vmstoolkit's ``allocator``; one call, before
    the first CUDA tensor. Returns the handle (calling it twice returns the same one).

    ``paged`` is served by compiled entry points (:mod:`~vmstoolkit.integrations.native_torch`:
    no Python unless the driver has work); every other allocator by ``ctypes`` callbacks into
    its Python implementation."""
    global _INSTALLED
    if _INSTALLED is not None:
        if _INSTALLED.allocator_name != allocator:
            raise VmsError(f"vmstoolkit allocator {_INSTALLED.allocator_name!r} is already installed in PyTorch; it cannot be changed to {allocator!r}")
        return _INSTALLED
    torch = _import_torch()
    if allocator == "paged":
        from vmstoolkit.integrations.native_torch import NativeHook

        make_allocator(allocator, make_driver("sim"), **options).close()  # validate the options early
        handle = NativeHook(lambda device: make_driver("cuda", device=device), **options)
    else:
        handle = make_handle(allocator, **options)
    custom = torch._C._cuda_customAllocator(handle.alloc_ptr, handle.free_ptr)
    try:
        torch._C._cuda_changeCurrentAllocator(custom)
    except RuntimeError as e:
        raise VmsError(f"PyTorch refused the allocator ({e}); install it before the first CUDA allocation") from None
    handle._torch_allocator = custom
    _INSTALLED = handle
    return handle


@contextmanager
def vmstoolkit_allocator(allocator: str = "vms", **options):
    """``with vmstoolkit_allocator("vms") as h:`` installs the allocator (once per process) and
    yields its handle; on exit it waits for the GPU so the statistics are final."""
    handle = install(allocator, **options)
    try:
        yield handle
    finally:
        import torch

        torch.cuda.synchronize()


def installed() -> TorchAllocatorHandle | None:
    return _INSTALLED
