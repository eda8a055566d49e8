"""Completion events and copies of the CUDA backend straight through the driver (cuda-bindings).

Numba's ``cuda.event()`` plus ``record`` cost 18 us of host time on an H100 and its
``copy_to_device`` more (``experiments/results/kernels-h200/run12-h100``, ``launch_cost.json``):
each asks Numba for the current context first. The backend makes one event per vertex and one
copy per offload or reload, so on a decode step of thousands of small vertices these are a large
part of the host time that is left once kernel launches are one driver call
(:mod:`vmstoolkit.kernels._launch`).

:class:`DriverEvent` has the three methods the backend calls (``record``, ``wait``, ``query``)
and is destroyed by :meth:`DriverEvents.close`; :func:`copy_async` is
``cuMemcpy{HtoD,DtoH,DtoD}Async`` on a device view and a pinned host array.

**Opt-in** (``CudaBackend(driver_events=True)`` or ``VMSTOOLKIT_DRIVER_EVENTS=1``) until a GPU run
has checked it: the CPU tests run it against a recording stand-in of the driver only; the GPU
test is ``tests/gpu/test_model_gpu.py::test_generation_with_driver_events_equals_transformers``.
"""

from __future__ import annotations

import os

from vmstoolkit.exec.errors import CudaCallError, InvalidOptionError, InvalidShapeError

ENV = "VMSTOOLKIT_DRIVER_EVENTS"


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip() == "1"


def _driver():
    from cuda.bindings import driver

    return driver


def _check(err, what: str) -> None:
    d = _driver()
    if err != d.CUresult.CUDA_SUCCESS:
        raise CudaCallError(getattr(err, "name", str(err)), what)


class DriverEvent:
    """A CUDA event without timing, made in the current context."""
    __slots__ = ("handle",)

    def __init__(self, handle) -> None:
        self.handle = handle

    def record(self, stream: int) -> None:
        (err,) = _driver().cuEventRecord(self.handle, stream)
        _check(err, "cuEventRecord of a vertex's end event")

    def wait(self, stream: int) -> None:
        (err,) = _driver().cuStreamWaitEvent(stream, self.handle, 0)
        _check(err, "cuStreamWaitEvent on a predecessor's end event")

    def query(self) -> bool:
        d = _driver()
        (err,) = d.cuEventQuery(self.handle)
        if err == d.CUresult.CUDA_SUCCESS:
            return True
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check(err, "cuEventQuery of a vertex's end event")
        return False


class DriverEvents:
    """The events of one backend: made on demand in the current context (that of ``gpu``),
    destroyed together per GPU at :meth:`close`, which the backend calls in that GPU's context
    after synchronizing it (an event still pending must not go while a stream waits on it)."""

    def __init__(self) -> None:
        self._made: dict[int, list[DriverEvent]] = {}

    def new(self, gpu: int = 0) -> DriverEvent:
        d = _driver()
        err, handle = d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
        _check(err, "cuEventCreate of a vertex's end event")
        ev = DriverEvent(handle)
        self._made.setdefault(gpu, []).append(ev)
        return ev

    def __len__(self) -> int:
        return sum(len(v) for v in self._made.values())

    def close(self, gpu: int) -> None:
        d = _driver()
        for ev in self._made.pop(gpu, []):
            d.cuEventDestroy(ev.handle)


def copy_async(kind: str, device_view, other, stream: int) -> None:
    """``kind`` "h2d" (the pinned host array ``other`` into ``device_view``), "d2h"
    (``device_view`` into ``other``) or "d2d" (the device view ``other`` into ``device_view``),
    ``device_view.nbytes`` bytes on ``stream``. Sizes that differ, or a host array that is not
    contiguous, are an InvalidShapeError before any copy (Numba's copies check the same)."""
    d = _driver()
    dev = device_view.device_ctypes_pointer.value
    n = device_view.nbytes
    if other.nbytes != n:
        raise InvalidShapeError(f"copy {kind}: {n} bytes on the device, {other.nbytes} on the other side")
    if kind in ("h2d", "d2h") and not other.flags["C_CONTIGUOUS"]:
        raise InvalidShapeError(f"copy {kind}: the host array of shape {other.shape} is not contiguous")
    if kind == "h2d":
        (err,) = d.cuMemcpyHtoDAsync(dev, other.ctypes.data, n, stream)
    elif kind == "d2h":
        (err,) = d.cuMemcpyDtoHAsync(other.ctypes.data, dev, n, stream)
    elif kind == "d2d":
        (err,) = d.cuMemcpyDtoDAsync(dev, other.device_ctypes_pointer.value, n, stream)
    else:
        raise InvalidOptionError(f"copy kind must be 'h2d', 'd2h' or 'd2d', not {kind!r}")
    _check(err, f"cuMemcpy {kind} of {n} bytes")
