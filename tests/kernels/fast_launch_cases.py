"""Run by ``test_fast_launch.py`` in a process without Numba's CUDA simulator (which replaces the
driver modules these cases need; they need no GPU).

The fast launch path (kernels/_launch.py) on the CPU: its parameter block equals Numba's own
marshalling (``_Kernel._prepare_args``) for arrays of every layout and for scalars, its layout
key equals ``DeviceNDArray._numba_type_``'s, and a wrapped dispatcher launches through Numba
until a signature is planned, then through one driver call with that block. The GPU test
(``tests/gpu/test_fast_launch_gpu.py``) checks the kernels' results."""

import ctypes
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vmstoolkit.kernels import _launch as L

import numba
from numba.cuda import dispatcher as dispatcher_mod
from numba.cuda.cudadrv import devicearray


@pytest.fixture(autouse=True)
def _cuda_backend():
    """This folder's conftest skips a kernel test without the simulator or a GPU; these cases
    need neither."""


class _Ptr:
    def __init__(self, value):
        self.value = value


class _GpuData:
    def __init__(self, address):
        self.device_ctypes_pointer = _Ptr(address)


def device_array(shape, strides, dtype, address=0x7F0000001000):
    return devicearray.DeviceNDArray(tuple(shape), tuple(strides), np.dtype(dtype), gpu_data=_GpuData(address))


def numba_values(args) -> list[int]:
    """Numba's own parameter list for ``args``, as int64 bit patterns."""
    class _K:
        extensions = []

    out: list = []
    for a in args:
        dispatcher_mod._Kernel._prepare_args(_K(), numba.typeof(a), a, 0, [], out)
    bits = []
    for v in out:
        if isinstance(v, ctypes.c_float):
            bits.append(struct.unpack("<i", struct.pack("<f", v.value))[0])
        elif isinstance(v, ctypes.c_double):
            bits.append(struct.unpack("<q", struct.pack("<d", v.value))[0])
        elif isinstance(v, ctypes._SimpleCData):
            bits.append(int(v.value))
        else:
            bits.append(int(v))
    return bits


def ours(args) -> list[int]:
    slots = [L.slots_for(numba.typeof(a)) for a in args]
    out: list = []
    L.pack(slots, args, out)
    return out


arrays = st.builds(
    lambda shape, order, step, dtype: _strided(shape, order, step, dtype),
    st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from("CF"), st.integers(1, 3),
    st.sampled_from(["float32", "uint16", "int32", "float64"]))


def contiguous_strides(shape, itemsize: int, order: str) -> tuple:
    """The byte strides of a contiguous array of ``shape`` in ``order`` "C" or "F"."""
    out, acc = [0] * len(shape), itemsize
    for d in (range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))):
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def _strided(shape, order, step, dtype):
    item = np.dtype(dtype).itemsize
    strides = list(contiguous_strides(tuple(shape), item, order))
    strides[-1 if order == "C" else 0] *= step  # every step-th element of the innermost dimension
    if step > 1:  # the outer strides grow with it
        inner = -1 if order == "C" else 0
        dims = range(len(shape) - 2, -1, -1) if order == "C" else range(1, len(shape))
        acc = strides[inner] * shape[inner]
        for d in dims:
            strides[d] = acc
            acc *= shape[d]
    return device_array(shape, strides, dtype)


@settings(max_examples=150, deadline=None)
@given(arrays)
def test_the_layout_key_is_numbas_type(a):
    t = a._numba_type_
    assert L.arg_key(a) == (a.dtype, t.ndim, t.layout)


@settings(max_examples=150, deadline=None)
@given(st.lists(arrays, min_size=1, max_size=3), st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(-2**31, 2**31 - 1),
       st.floats(allow_nan=False), st.booleans())
def test_the_parameter_block_is_numbas(arrs, f32, i, f64, b):
    args = [*arrs, np.float32(f32), i, f64, b, np.int64(i), np.float64(f64)]
    assert ours(args) == numba_values(args)


def test_broadcast_arrays():
    # (an empty DeviceNDArray cannot be made without a CUDA context: the GPU test has one)
    bc = device_array((4, 3), (0, 4), "float32")  # a broadcast row: layout "A", its zero stride passed
    assert L.arg_key(bc)[2] == bc._numba_type_.layout == "A"
    assert ours([bc]) == numba_values([bc])


def test_what_it_does_not_plan_has_no_key():
    assert L.arg_key(np.zeros(3)) is None  # a host array: Numba copies it, so it keeps launching it
    assert L.arg_key("text") is None
    assert L.arg_key(np.float32(1)) is np.float32


class _FakeDispatcher:
    """Records Numba's launches; its one overload is the kernel typed from the first call."""
    __name__ = "fake"
    targetoptions: dict = {}

    def __init__(self):
        self.numba_launches = []
        self.overloads = {}

    def typeof_pyval(self, v):
        return numba.typeof(v)

    def __getitem__(self, cfg):
        def run(*args):
            self.numba_launches.append((cfg, args))
            self.overloads[tuple(numba.typeof(a) for a in args)] = _FakeOverload()
        return run


class _FakeOverload:
    class _codelibrary:
        @staticmethod
        def get_cufunc():
            class F:
                handle = 0xABC
            return F()


def test_a_wrapped_kernel_goes_through_numba_until_planned_then_one_driver_call(monkeypatch):
    from cuda.bindings import driver

    launched = []

    def fake_launch(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        n = len(ours(args))
        ptrs = (ctypes.c_void_p * n).from_address(params)
        launched.append(([ctypes.c_int64.from_address(p).value for p in ptrs], (gx, gy, gz), (bx, by, bz), shmem,
                         int(fn)))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(L, "current_device_ordinal", lambda: 0)
    monkeypatch.setattr(driver, "cuLaunchKernel", fake_launch)
    d = _FakeDispatcher()
    k = L.FastKernel(d)
    a = device_array((8, 4), (16, 4), "float32")
    args = (a, np.float32(0.5), 3)
    k[(2, 3), 64, 0](*args)
    assert len(d.numba_launches) == 1 and not launched
    k[(2, 3), 64, 0](*args)
    k[(2, 3), 64, 0](*args)
    assert len(d.numba_launches) == 1 and len(launched) == 2 and k.fast_launches == 2
    values, grid, block, shmem, fn = launched[0]
    assert values == numba_values(list(args)) and grid == (2, 3, 1) and block == (64, 1, 1) and shmem == 0
    assert fn == 0xABC
    # another layout is another signature: Numba again, once
    b = device_array((8, 4), (4, 32), "float32")
    k[1, 32, 0](b, np.float32(0.5), 3)
    assert len(d.numba_launches) == 2
    # an argument the fast path does not take (a host array) always goes through Numba
    k[1, 32, 0](np.zeros(3), np.float32(0.5), 3)
    k[1, 32, 0](np.zeros(3), np.float32(0.5), 3)
    assert len(d.numba_launches) == 4 and len(launched) == 2


def test_a_failed_driver_launch_is_one_line(monkeypatch):
    from cuda.bindings import driver

    from vmstoolkit.errors import KernelError

    monkeypatch.setattr(L, "current_device_ordinal", lambda: 0)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    k = L.FastKernel(_FakeDispatcher())
    a = device_array((8, 4), (16, 4), "float32")
    k[1, 32, 0](a)
    with pytest.raises(KernelError, match="cuLaunchKernel of fake .*CUDA_ERROR_INVALID_VALUE"):
        k[1, 32, 0](a)


def test_off_under_the_simulator_and_by_the_variable(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(L, "simulating", lambda: True)
    assert L.fast(sentinel) is sentinel
    monkeypatch.setattr(L, "simulating", lambda: False)
    monkeypatch.setenv(L.ENV, "0")
    assert L.fast(sentinel) is sentinel
    monkeypatch.setenv(L.ENV, "1")
    assert isinstance(L.fast(_FakeDispatcher()), L.FastKernel)


def test_flat_views_are_made_once_per_array():
    """The elementwise launchers flatten their operands every launch; a DeviceNDArray keeps its
    view (kernels/_util.flat), so the runtime's cached views cost no reshape after the first."""
    from vmstoolkit.kernels._util import flat

    a = device_array((3, 4), (16, 4), "float32", address=0x7F0000002000)
    v = flat(a)
    assert v.shape == (12,) and v.strides == (4,) and v.device_ctypes_pointer.value == 0x7F0000002000
    assert flat(a) is v and flat(v) is v
    assert ours([v]) == numba_values([a.reshape(12)])


def test_without_a_driver_there_is_no_device_and_no_plan():
    """Without a driver library (this machine) or without a current context, the ordinal is None,
    not an exception: a launch then goes to Numba, whose own error says what is missing."""
    from vmstoolkit.kernels._util import current_device_ordinal

    assert current_device_ordinal() is None
