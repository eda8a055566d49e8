"""vmstoolkit allocators behind CuPy arrays, the way ``rmm.allocators.cupy`` serves RMM's.

    import vmstoolkit.integrations.cupy as vc
    handle = vc.install("vms")          # any allocator by name, with its options
    x = cupy.ones((4096, 4096))         # served by the vms pools of the current device
    handle.stats()["reserved_bytes.all.current"]
    handle.uninstall()                  # CuPy's previous allocator again

CuPy asks its allocator for ``nbytes`` on the current device and gets a ``MemoryPointer`` back
(``cupy.cuda.set_allocator``). :meth:`CupyHandle.malloc` is that function:

- **devices**: one allocator per device, over ``make_driver("cuda", device=...)``, made on the
  device's first allocation;
- **streams**: the allocation is made for CuPy's current stream
  (``cupy.cuda.get_current_stream().ptr``) and freed on that same stream, so the allocator's
  stream-ordered reuse (:mod:`vmstoolkit.pools.streams`) holds: a freed block is reused at once
  by its own stream, by another once the work queued before the free has finished;
- **freeing**: the ``UnownedMemory`` CuPy keeps owns a small :class:`_Owner` whose ``__del__``
  frees the block when CuPy drops its last reference (RMM's ``DeviceBuffer`` plays this part).
  A free arriving from the garbage collector while the allocator runs is queued by the
  :class:`~vmstoolkit.integrations.bridge.AllocatorBridge`;
- **out of memory**: a request the allocator cannot serve, even after a garbage collection has
  run the frees of arrays held only by reference cycles, raises
  ``cupy.cuda.memory.OutOfMemoryError`` (a ``MemoryError``; the allocator's own error is its
  ``__cause__`` and a note), never a null pointer. Other allocator errors raise as themselves.

Unlike PyTorch, CuPy may change allocators at any time: arrays already made keep the memory
(and the allocator) they came from, so :meth:`CupyHandle.uninstall` only routes new requests
back. The one CuPy call in the hot path besides the two constructors is the device and stream
query; the allocator's cost is the bridge's (a lock) plus the allocator's own.
"""

from __future__ import annotations

import atexit
import gc
import threading

from vmstoolkit.errors import DriverOutOfMemoryError, NoGPUError, OutOfMemoryError, VmsError
from vmstoolkit.integrations import IntegrationHandle
from vmstoolkit.integrations.bridge import AllocatorBridge, cuda_driver, per_device
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.registry import check_allocator

_exiting = False  # at interpreter exit the process's memory goes with it: no frees then


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True


def _import_cupy():
    """The ``cupy`` module, or :class:`~vmstoolkit.errors.NoGPUError` naming what is missing.
    Tests replace this function to hand in a stand-in of the CuPy names used here."""
    try:
        import cupy
    except ImportError as e:
        raise NoGPUError(f"CuPy is not installed ({e}): `pip install cupy-cuda13x` (or the wheel of your CUDA "
                         "version) to use vmstoolkit allocators inside CuPy") from None
    if not cupy.cuda.is_available():
        raise NoGPUError("CuPy sees no CUDA GPU: the CuPy integration needs one (replay works without: "
                         "`vmstoolkit replay`)")
    return cupy


class _Owner:
    """Owns one allocation for the ``UnownedMemory`` CuPy holds: dropping the last reference
    frees the block on the stream it was allocated for. One small object per allocation."""

    __slots__ = ("bridge", "ptr", "stream")

    def __init__(self, bridge: AllocatorBridge, ptr: int, stream: int) -> None:
        self.bridge = bridge
        self.ptr = ptr
        self.stream = stream

    def __del__(self) -> None:
        if not _exiting:
            self.bridge.free(self.ptr, self.stream)  # never raises: a bad free is recorded


class CupyHandle(IntegrationHandle):
    """CuPy's allocator function over one vmstoolkit allocator per device.

    ``bridge(device)``, ``allocator(device)`` and ``stats(device)`` take the device CuPy
    considers current when ``device`` is None; ``memory_stats``, ``max_memory_reserved`` and
    ``max_memory_allocated`` answer as for the PyTorch handle."""

    def __init__(self, name: str, cupy, driver_factory=None, options: dict | None = None) -> None:
        self.allocator_name = name
        self._cuda = cupy.cuda
        self._driver_factory = driver_factory or cuda_driver
        self._options = dict(options or {})
        self.bridges: dict[int, AllocatorBridge] = {}
        self._make_lock = threading.Lock()
        self._previous = None  # CuPy's allocator before install(); set by install
        self.installed = False

    # -- devices -----------------------------------------------------------------------------
    def bridge(self, device: int | None = None) -> AllocatorBridge:
        """The device's bridge, its allocator made on first use, once, whichever threads ask."""
        if device is None:
            device = self._cuda.runtime.getDevice()
        return per_device(self.bridges, self._make_lock, device, lambda: AllocatorBridge(
            make_allocator(self.allocator_name, self._driver_factory(device), **self._options)))

    def empty_cache(self) -> None:
        """Give every device's cached memory back to the driver."""
        for b in list(self.bridges.values()):
            b.empty_cache()

    # -- CuPy's allocator function -------------------------------------------------------------
    def malloc(self, nbytes: int):
        """``cupy.cuda.MemoryPointer`` to ``nbytes`` new bytes on CuPy's current device, for its
        current stream; raises ``cupy.cuda.memory.OutOfMemoryError`` when they cannot be had."""
        cuda = self._cuda
        device = cuda.runtime.getDevice()
        if nbytes == 0:  # CuPy's own pools hand out a null pointer for an empty array
            return cuda.MemoryPointer(cuda.UnownedMemory(0, 0, None, device), 0)
        stream = cuda.get_current_stream().ptr
        b = self.bridge(device)
        ptr = b.malloc(nbytes, stream, report=False)
        if not ptr and _out_of_memory(b.last_error):
            gc.collect()  # arrays held only by reference cycles give their memory back first
            ptr = b.malloc(nbytes, stream, report=False)
        if not ptr:
            raise self._error(nbytes, device, b)
        mem = cuda.UnownedMemory(ptr, nbytes, _Owner(b, ptr, stream), device)
        return cuda.MemoryPointer(mem, 0)

    def _error(self, nbytes: int, device: int, b: AllocatorBridge) -> Exception:
        """CuPy's out-of-memory error for an allocation the allocator cannot serve (the
        allocator's error as its cause); any other allocator error as it is."""
        err = b.last_error
        if not _out_of_memory(err):
            return err
        oom = self._cuda.memory.OutOfMemoryError(nbytes, b.allocator_stats().allocated_bytes, 0)
        oom.add_note(f"vmstoolkit {self.allocator_name!r} on device {device}: {type(err).__name__}: {err}")
        oom.__cause__ = err
        return oom

    # -- installing ----------------------------------------------------------------------------
    def install(self) -> CupyHandle:
        """Make :meth:`malloc` CuPy's allocator, remembering the one it replaces."""
        if not self.installed:
            self._previous = self._cuda.get_allocator()
            self._cuda.set_allocator(self.malloc)
            self.installed = True
        return self

    def uninstall(self) -> None:
        """CuPy's previous allocator serves new requests again; arrays made meanwhile keep their
        memory until dropped, and cached memory goes back to the driver now. Handles installed
        one over another come off in reverse order."""
        if not self.installed:
            return
        if self._cuda.get_allocator() != self.malloc:
            raise VmsError(f"vmstoolkit {self.allocator_name!r} is no longer CuPy's allocator (another was "
                           "installed over it): uninstall that one first")
        self._cuda.set_allocator(self._previous)
        self.installed = False
        self.empty_cache()


def _out_of_memory(err: BaseException | None) -> bool:
    return isinstance(err, (OutOfMemoryError, DriverOutOfMemoryError))


def make_handle(name: str = "vms", driver_factory=None, **options) -> CupyHandle:
    """The handle without installing it (``driver_factory(device) -> VMMDriver``, default the
    CUDA driver). An unknown name or a bad option raises
    :class:`~vmstoolkit.errors.ConfigError` before anything is built; a missing CuPy or GPU
    :class:`~vmstoolkit.errors.NoGPUError`."""
    check_allocator(name, options)
    return CupyHandle(name, _import_cupy(), driver_factory, options)


def install(name: str = "vms", **options) -> CupyHandle:
    """Make CuPy allocate device memory through vmstoolkit's allocator ``name`` (any registered
    one, with its options) and return the handle; ``handle.uninstall()`` undoes it."""
    return make_handle(name, **options).install()


__all__ = ["CupyHandle", "install", "make_handle"]
