"""Kernel launches past Numba's dispatcher: one driver call per launch once a kernel has run.

``kernel[grid, block, stream](*args)`` through numba-cuda costs 50-60 us of host time on an H100
(``experiments/launch_cost_gpu.py``, 2026-12-07: ``dispatch_us`` 57 at a decode shape, of which
typing the arguments is 5-8): each array argument is wrapped in a memory view, every scalar in a
ctypes object, and cuda.core builds a launch configuration. Decode runs thousands of small
kernels a token, so those microseconds are the step (issue 32: about 0.3 ms of host time a
vertex, where the GPU needs a few).

:func:`fast` wraps a dispatcher. The first launch of each argument signature (per device) goes
through Numba as before: it compiles, launches, and the wrapper then reads the compiled kernel's
driver handle and the parameter layout Numba's own marshalling uses (``_Kernel._prepare_args``:
an array is meminfo, parent, nitems, itemsize, data, shape..., strides...; a scalar one value).
Later launches of that signature pack the values into a per-signature parameter block and call
``cuLaunchKernel`` once. Anything the fast path does not plan for (an argument that is not a
``DeviceNDArray`` or a plain scalar, a debug kernel, a dispatcher with argument extensions, a
type Numba typed another way) goes through Numba every time, so the result never depends on it.

The signature key mirrors ``DeviceNDArray._numba_type_``: dtype, ndim and layout ("C" if
C-contiguous and not broadcast, else "F" if F-contiguous, else "A"); scalars by Python class.
The plan stores the types Numba itself inferred at the first launch; a later argument whose key
matches takes that overload. Strides are the array's own, as Numba passes a ``DeviceNDArray``'s
(its ``_strided_memory_view_shim``).

Off under the simulator (the dispatcher is returned unchanged) and with
``VMSTOOLKIT_FAST_LAUNCH=0``; :func:`set_active` switches plans off and on in a running process.

On the GPU (H100, 2026-12-07): results bit-equal to Numba's launches
(``tests/gpu/test_fast_launch_gpu.py``) and the same greedy tokens. The decode time of the tiny
LLaMA checkpoint is not shown to change: the medians of three noisy runs a mode put it at 0.48
and 0.93 of Numba's, with 95% intervals of 0.36-1.76 and 0.80-1.48
(``experiments/fast_launch_gpu.py``, ``experiments/results/run-model-h200/fast-launch-h100``).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading

from vmstoolkit._cuda_handles import raw_stream
from vmstoolkit.errors import KernelError

from ._util import current_device_ordinal, simulating

ENV = "VMSTOOLKIT_FAST_LAUNCH"
_F32, _I32 = struct.Struct("<f"), struct.Struct("<i")
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
_UNPLANNED = object()  # a key whose launches always go through Numba


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


class _Switch:
    """Whether wrapped kernels take their plans now (:func:`set_active`), and how many launches
    did (``count``): an A/B of the two paths in one process, and a check that a path ran."""
    active = True
    count = 0


def set_active(on: bool) -> bool:
    """Route wrapped kernels' launches through their plans (True) or Numba (False); returns the
    previous setting. The wrapping itself is decided when a kernel is made (:func:`fast`)."""
    prev, _Switch.active = _Switch.active, bool(on)
    return prev


def fast_launch_count() -> int:
    """Launches made through a plan so far in this process."""
    return _Switch.count


def fast(dispatcher):
    """``dispatcher`` with the fast launch path (module docstring), or unchanged where it is off."""
    if simulating() or not enabled():
        return dispatcher
    return FastKernel(dispatcher)


def jit(fn=None, **opts):
    """``cuda.jit`` for a kernel (never a device function), with the fast launch path:
    ``@jit`` or ``@jit(max_registers=...)``."""
    from numba import cuda

    if fn is None:
        return lambda f: fast(cuda.jit(**opts)(f))
    return fast(cuda.jit(fn))


def layout_of(shape, strides, c_contig: bool, f_contig: bool, size: int) -> str:
    """Numba's layout letter for an array (``DeviceNDArray._numba_type_``)."""
    broadcast = 0 in strides and size != 0
    if c_contig and not broadcast:
        return "C"
    if f_contig and not broadcast:
        return "F"
    return "A"


def _device_array_class():
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray


def arg_key(a, device_array=None):
    """The signature key of one argument, or None where the fast path does not handle it."""
    device_array = device_array or _device_array_class()
    if type(a) is device_array:
        d = a._dummy
        return (a.dtype, a.ndim, layout_of(a.shape, a.strides, d.is_c_contig, d.is_f_contig, a.size))
    if isinstance(a, (bool, int, float)) or type(a).__module__ == "numpy" and hasattr(a, "dtype") \
            and getattr(a, "ndim", 1) == 0:
        return type(a)
    return None


class Slots:
    """How one argument's values fill the parameter block: ``kind`` "array" (with its ndim and
    layout) or a scalar's packing ("i", "f32", "f64", "b")."""
    __slots__ = ("kind", "ndim", "layout", "itemsize")

    def __init__(self, kind: str, ndim: int = 0, layout: str = "", itemsize: int = 0):
        self.kind, self.ndim, self.layout, self.itemsize = kind, ndim, layout, itemsize

    @property
    def count(self) -> int:
        return 5 + 2 * self.ndim if self.kind == "array" else 1


def slots_for(numba_type) -> Slots | None:
    """The packing of one argument of Numba type ``numba_type`` (None: not handled)."""
    from numba.core import types

    if isinstance(numba_type, types.Array):
        import numpy as np

        return Slots("array", numba_type.ndim, numba_type.layout, np.dtype(str(numba_type.dtype)).itemsize)
    if numba_type == types.boolean:
        return Slots("b")
    if isinstance(numba_type, types.Integer):
        return Slots("i")
    if numba_type == types.float32:
        return Slots("f32")
    if numba_type == types.float64:
        return Slots("f64")
    return None


def pack(slots: list[Slots], args, out: list) -> None:
    """Append the int64 parameter values of ``args`` to ``out``, as Numba's marshalling lays
    them out (one 8-byte slot a parameter; a 4-byte parameter in its low bytes)."""
    for s, a in zip(slots, args):
        k = s.kind
        if k == "array":
            ptr = a.device_ctypes_pointer.value
            shape = a.shape
            out += (0, 0, a.size, s.itemsize, ptr or 0)
            out += shape
            out += a.strides
        elif k == "i" or k == "b":
            out.append(int(a))
        elif k == "f32":
            out.append(_I32.unpack(_F32.pack(float(a)))[0])
        else:
            out.append(_I64.unpack(_F64.pack(float(a)))[0])


class Plan:
    """One signature's compiled kernel on one device and its parameter block."""
    __slots__ = ("fn", "slots", "values", "params", "lock")

    def __init__(self, fn, slots: list[Slots]):
        n = sum(s.count for s in slots)
        self.fn, self.slots = fn, slots
        self.values = (ctypes.c_int64 * max(n, 1))()
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * max(n, 1))(*[base + 8 * i for i in range(max(n, 1))])
        self.lock = threading.Lock()

    def launch(self, grid, block, shmem: int, stream, args, name: str) -> None:
        from cuda.bindings import driver

        vals: list = []
        pack(self.slots, args, vals)
        with self.lock:
            self.values[:len(vals)] = vals
            (err,) = driver.cuLaunchKernel(self.fn, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                           shmem, stream, ctypes.addressof(self.params), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise KernelError(f"cuLaunchKernel of {name} (grid {grid}, block {block}, {shmem} bytes of shared "
                              f"memory) failed: {err.name}")


def _dims(d) -> tuple:
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(d)
    return d + (1,) * (3 - len(d))


class FastKernel:
    """A Numba CUDA dispatcher with the fast launch path (module docstring). Indexing and
    calling work as on the dispatcher; every other attribute is the dispatcher's."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.plans: dict = {}
        self.fast_launches = 0
        opts = getattr(dispatcher, "targetoptions", {}) or {}
        self._plannable = not opts.get("debug") and not opts.get("extensions")
        self._device_array = _device_array_class()

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)

    def __getitem__(self, cfg):
        if not isinstance(cfg, tuple) or len(cfg) not in (2, 3, 4):
            return self.dispatcher[cfg]
        grid, block = cfg[0], cfg[1]
        stream = cfg[2] if len(cfg) > 2 else 0
        shmem = cfg[3] if len(cfg) > 3 else 0
        return lambda *args: self.launch(grid, block, stream, shmem, args)

    def launch(self, grid, block, stream, shmem, args) -> None:
        if self._plannable and _Switch.active:
            dev = current_device_ordinal()
            keys = tuple(arg_key(a, self._device_array) for a in args)
            key = (dev, shmem, keys)
            plan = self.plans.get(key)
            if plan is not None and plan is not _UNPLANNED:
                plan.launch(_dims(grid), _dims(block), shmem, raw_stream(stream), args,
                            getattr(self.dispatcher, "__name__", "kernel"))
                self.fast_launches += 1
                _Switch.count += 1
                return
            self.dispatcher[grid, block, stream, shmem](*args)
            if plan is None:
                self.plans[key] = self._plan(args, keys, dev)
            return
        self.dispatcher[grid, block, stream, shmem](*args)

    def _plan(self, args, keys, dev):
        if dev is None or any(k is None for k in keys):
            return _UNPLANNED
        d = self.dispatcher
        try:
            argtypes = tuple(d.typeof_pyval(a) for a in args)
            kernel = d.overloads.get(argtypes)
        except Exception:  # noqa: BLE001 - whatever Numba cannot answer, it keeps doing itself
            return _UNPLANNED
        if kernel is None:
            return _UNPLANNED
        slots = [slots_for(t) for t in argtypes]
        if any(s is None for s in slots):
            return _UNPLANNED
        for s, k in zip(slots, keys):  # the key's layout must be the one Numba typed
            if s.kind == "array" and (not isinstance(k, tuple) or k[2] != s.layout):
                return _UNPLANNED
        from cuda.bindings import driver

        handle = kernel._codelibrary.get_cufunc().handle
        return Plan(driver.CUfunction(int(handle)), slots)
