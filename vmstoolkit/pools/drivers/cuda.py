"""The real VMM driver on ``cuda.bindings.driver``.

Imported only by :func:`~vmstoolkit.pools.drivers.make_driver` (pools never import it). Every
failing call raises :class:`~vmstoolkit.errors.DriverError` naming the CUresult and the values
involved; a machine without a usable GPU raises :class:`~vmstoolkit.errors.NoGPUError`.
Handles cross the interface as ints; the driver objects stay here.
"""

from __future__ import annotations

import threading

from vmstoolkit.errors import DriverError, DriverOutOfMemoryError, NoGPUError
from vmstoolkit.pools.drivers.base import Handle, VMMDriver


def _load():
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:  # pragma: no cover - cuda-bindings is a dependency
        raise NoGPUError(f"cuda-bindings is not installed ({e}); the simulated driver needs no GPU") from None
    return cu


def cuda_init(device: int = 0):
    """``(cu, device handle)`` after cuInit; :class:`NoGPUError` when there is no usable GPU.
    Cost: O(1); three driver calls (``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet``), none waits."""
    cu = _load()
    try:
        (err,) = cu.cuInit(0)
    except Exception as e:  # the driver library itself is missing: no NVIDIA driver here
        raise NoGPUError(f"no CUDA driver on this machine ({type(e).__name__}: {e}); use the simulated driver (--device sim)") from None
    if err != cu.CUresult.CUDA_SUCCESS:
        raise NoGPUError(f"cuInit failed with {_name(cu, err)}: no usable GPU; use the simulated driver (--device sim)")
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        raise NoGPUError("no CUDA device found; use the simulated driver (--device sim)")
    if not 0 <= device < count:
        raise NoGPUError(f"CUDA device {device} does not exist (this machine has {count})")
    err, dev = cu.cuDeviceGet(device)
    _check(cu, err, f"cuDeviceGet({device})")
    return cu, dev


def _name(cu, err) -> str:
    try:
        e, name = cu.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def _check(cu, err, what: str) -> None:
    if err != cu.CUresult.CUDA_SUCCESS:
        name = _name(cu, err)
        cls = DriverOutOfMemoryError if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else DriverError
        raise cls(name, what, code=int(err))


class ContextBinding:
    """``with binding:`` makes ``ctx`` current on the calling thread and afterwards puts back
    what was current before. Context-bound calls (``cuCtxSynchronize``, ``cuMemGetInfo``,
    ``cuMemAlloc``...) fail with ``CUDA_ERROR_INVALID_CONTEXT`` on a thread with none, and
    PyTorch calls its allocator from threads that may have none (seen on the H200: the autograd
    thread running ``save_on_cpu``'s unpack hook); pushing rather than setting leaves a thread
    that works on another device as it was. Reentrant: nested blocks check nothing."""

    def __init__(self, cu, ctx) -> None:
        self._cu = cu
        self._ctx = ctx
        self._key = int(ctx)
        self._tls = threading.local()

    def __enter__(self) -> None:
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        if depth == 0:
            cu = self._cu
            err, cur = cu.cuCtxGetCurrent()
            _check(cu, err, "cuCtxGetCurrent")
            tls.pushed = int(cur) != self._key
            if tls.pushed:
                (err,) = cu.cuCtxPushCurrent(self._ctx)
                _check(cu, err, "cuCtxPushCurrent")
        tls.depth = depth + 1

    def __exit__(self, *exc) -> None:
        tls = self._tls
        tls.depth -= 1
        if tls.depth == 0 and tls.pushed:
            tls.pushed = False
            err, _ = self._cu.cuCtxPopCurrent()
            if exc[0] is None:
                _check(self._cu, err, "cuCtxPopCurrent")


class CudaDriver(VMMDriver):
    """VMM calls on a real GPU, in the device's primary context (shared with PyTorch and Numba).

    Each public call costs the CUDA driver call it names and, outside :meth:`bound`, a
    ``cuCtxGetCurrent`` (plus a push/pop pair when another context is current) to bind the
    context. Only :meth:`synchronize` blocks the host by design."""

    name = "cuda"

    def __init__(self, device: int = 0, peers: tuple[int, ...] = ()) -> None:
        """``peers``: other devices that may read and write this driver's mappings (their
        kernels and copy engines; a VMM mapping is accessible only where access was set)."""
        super().__init__()
        cu, dev = cuda_init(device)
        self._cu = cu
        self.device = device
        self._dev = dev
        err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        _check(cu, err, f"cuDevicePrimaryCtxRetain({device})")
        self._ctx = ctx
        (err,) = cu.cuCtxSetCurrent(ctx)  # on this thread, as before; other threads bind per call
        _check(cu, err, "cuCtxSetCurrent")
        self._binding = ContextBinding(cu, ctx)
        self._events: dict = {}  # int key -> CUevent
        self._spare_events: list = []
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        for peer in sorted(set(peers) - {device}):
            cuda_init(peer)  # names a missing device
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = peer
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access.append(desc)
        err, gran = cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        _check(cu, err, "cuMemGetAllocationGranularity")
        self._granularity = int(gran)
        with self._binding:
            err, free, total = cu.cuMemGetInfo()
        _check(cu, err, "cuMemGetInfo")
        self._total = int(total)
        self._baseline_used = int(total) - int(free)
        self.peak_device_used = 0  # bytes the device reports in use above the baseline, at our peaks
        self._handles: dict[int, object] = {}
        self._closed = False

    @property
    def granularity(self) -> int:
        """The device's minimum ``cuMemCreate`` granularity in bytes (asked once, when made).
        Cost: O(1); no driver call."""
        return self._granularity

    @property
    def capacity(self) -> int:
        """The device's total memory in bytes (``cuMemGetInfo``, asked once, when made). Cost: O(1);
        no driver call."""
        return self._total

    def bound(self) -> ContextBinding:
        """The context manager that binds this device's primary context on the calling thread
        (:class:`ContextBinding`); every call of the driver runs inside it. Cost: O(1); entering it
        makes one ``cuCtxGetCurrent`` (plus ``cuCtxPushCurrent``/``cuCtxPopCurrent`` when another
        context is current) at the outermost level only."""
        return self._binding

    def _sample_device_used(self) -> None:
        with self._binding:
            err, free, total = self._cu.cuMemGetInfo()
        if err == self._cu.CUresult.CUDA_SUCCESS:
            used = int(total) - int(free) - self._baseline_used
            self.peak_device_used = max(self.peak_device_used, used)

    def _grow(self, nbytes: int) -> None:
        new_peak = self.physical_bytes + nbytes > self.peak_physical_bytes
        super()._grow(nbytes)
        if new_peak:
            self._sample_device_used()

    def replay_extra(self) -> dict:
        """What the device itself says: physical memory in use (cuMemGetInfo) at our peaks.
        Cost: O(1); one driver call (``cuDeviceGetName``; the peak was sampled as it happened)."""
        return {"device_used_at_peak": self.peak_device_used, "device": self.device_name()}

    def device_name(self) -> str:
        """The device's name (``cuDeviceGetName``), ``"?"`` when the driver cannot tell. Cost: O(1);
        one driver call."""
        err, name = self._cu.cuDeviceGetName(256, self._dev)
        return name.split(b"\0", 1)[0].decode() if err == self._cu.CUresult.CUDA_SUCCESS else "?"

    # -- the calls ------------------------------------------------------------------------
    def _create(self, size: int) -> Handle:
        cu = self._cu
        with self._binding:
            err, h = cu.cuMemCreate(size, self._prop, 0)
        _check(cu, err, f"cuMemCreate({size})")
        key = int(h)
        self._handles[key] = h
        return key

    def _release(self, handle: Handle) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemRelease(self._handles[handle])
        _check(cu, err, f"cuMemRelease({handle:#x})")
        del self._handles[handle]

    def _reserve(self, size: int, alignment: int) -> int:
        cu = self._cu
        with self._binding:
            err, ptr = cu.cuMemAddressReserve(size, alignment, 0, 0)
        _check(cu, err, f"cuMemAddressReserve({size}, alignment={alignment})")
        return int(ptr)

    def _free_address(self, va: int, size: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemAddressFree(va, size)
        _check(cu, err, f"cuMemAddressFree({va:#x}, {size})")

    def _map(self, va: int, size: int, handle: Handle, offset: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemMap(va, size, offset, self._handles[handle], 0)
        _check(cu, err, f"cuMemMap({va:#x}, {size}, offset={offset}, handle={handle:#x})")

    def _unmap(self, va: int, size: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemUnmap(va, size)
        _check(cu, err, f"cuMemUnmap({va:#x}, {size})")

    def _set_access(self, va: int, size: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemSetAccess(va, size, self._access, len(self._access))
        _check(cu, err, f"cuMemSetAccess({va:#x}, {size})")

    def _mem_alloc(self, size: int) -> int:
        cu = self._cu
        with self._binding:
            err, ptr = cu.cuMemAlloc(size)
        _check(cu, err, f"cuMemAlloc({size})")
        return int(ptr)

    def _mem_free(self, ptr: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemFree(ptr)
        _check(cu, err, f"cuMemFree({ptr:#x})")

    def _memset(self, va: int, size: int, value: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuMemsetD8(va, value, size)
        _check(cu, err, f"cuMemsetD8({va:#x}, {value}, {size})")

    def _mem_info(self) -> tuple[int, int]:
        cu = self._cu
        with self._binding:
            err, free, total = cu.cuMemGetInfo()
        _check(cu, err, "cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        """``cuCtxSynchronize``: wait until the device has finished all queued work. Cost: O(1) on the
        host and one driver call, which blocks until every stream of the context is idle."""
        with self._binding:
            (err,) = self._cu.cuCtxSynchronize()
        _check(self._cu, err, "cuCtxSynchronize")

    # -- streams and events: a small pool of events without timing, reused ---------------------
    def _record_event(self, stream: int) -> int:
        cu = self._cu
        with self._binding:
            if self._spare_events:
                ev = self._spare_events.pop()
            else:
                err, ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                _check(cu, err, "cuEventCreate")
            (err,) = cu.cuEventRecord(ev, stream)
        if err != cu.CUresult.CUDA_SUCCESS:
            self._spare_events.append(ev)
        _check(cu, err, f"cuEventRecord(stream={stream:#x})")
        key = int(ev)
        self._events[key] = ev
        return key

    def _event_done(self, event: int) -> bool:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuEventQuery(self._events[event])
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check(cu, err, "cuEventQuery")
        return True

    def _stream_wait(self, stream: int, event: int) -> None:
        cu = self._cu
        with self._binding:
            (err,) = cu.cuStreamWaitEvent(stream, self._events[event], 0)
        _check(cu, err, f"cuStreamWaitEvent(stream={stream:#x})")

    def _release_event(self, event: int) -> None:
        # recording an event again is legal while earlier waits on it are queued: they keep the
        # state they captured (cuStreamWaitEvent), so a released event is simply reused
        self._spare_events.append(self._events.pop(event))

    def close(self) -> None:
        """Release the primary context this driver retained (``cuDevicePrimaryCtxRelease``); a second close
        does nothing. Cost: O(1); one driver call (none on a second close). Spare events are not
        destroyed (``cuEventDestroy``)."""
        if self._closed:
            return
        self._closed = True
        (err,) = self._cu.cuDevicePrimaryCtxRelease(self._dev)
        _check(self._cu, err, "cuDevicePrimaryCtxRelease")


def device_info(device: int = 0) -> dict:
    """What the machine offers: GPU, driver, VMM support, granularity, memory.

    Raises :class:`NoGPUError` when there is no usable GPU.

    Cost: O(1); about twenty driver calls, none waits (``cuInit``, device queries and attributes, then a
    :class:`CudaDriver` made and closed: ``cuDevicePrimaryCtxRetain``, ``cuMemGetInfo``...).
    """
    cu, dev = cuda_init(device)
    attr = cu.CUdevice_attribute
    info: dict = {"device": device}
    err, name = cu.cuDeviceGetName(256, dev)
    info["name"] = name.split(b"\0", 1)[0].decode() if err == cu.CUresult.CUDA_SUCCESS else "?"
    err, version = cu.cuDriverGetVersion()
    info["driver_version"] = f"{version // 1000}.{version % 1000 // 10}" if err == cu.CUresult.CUDA_SUCCESS else "?"
    err, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    err2, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    info["compute_capability"] = f"{major}.{minor}"
    err, vmm = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
    info["vmm_supported"] = bool(vmm) if err == cu.CUresult.CUDA_SUCCESS else False
    err, count = cu.cuDeviceGetCount()
    info["device_count"] = int(count)
    drv = CudaDriver(device)
    try:
        info["granularity"] = drv.granularity
        free, total = drv.mem_info()
        info["free_bytes"], info["total_bytes"] = free, total
    finally:
        drv.close()
    return info
