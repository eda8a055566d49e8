"""The simulator's scheduler as tests/conftest.py installs it (tests/cudasim_barrier.py): the
barrier, early-exiting threads, the counting barriers and a thread's exception behave as the
stock simulator's. Every kernel test runs on it too."""

import sys

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels._util import simulating

pytestmark = pytest.mark.skipif(not simulating(), reason="the CUDA simulator's scheduler")


def test_it_is_the_one_installed():
    from numba.cuda.simulator import kernel as K

    assert getattr(K.BlockManager, "_vmstoolkit_barrier", False)


def test_barrier_orders_shared_memory_with_threads_that_exit_early():
    @cuda.jit
    def reverse(out):  # threads 0..7 write, sync, read their mirror; threads 8..11 leave at once
        buf = cuda.shared.array(8, np.int32)
        i = cuda.threadIdx.x
        if i >= 8:
            return
        buf[i] = i * 10
        cuda.syncthreads()
        out[cuda.blockIdx.x, i] = buf[7 - i] + cuda.syncthreads_count(i % 2) * 1000
        cuda.syncthreads()

    out = np.zeros((2, 8), np.int32)
    reverse[2, 12](out)
    want = np.array([(7 - i) * 10 + 4000 for i in range(8)], np.int32)
    assert (out == want).all()


def test_a_threads_exception_is_raised_and_names_the_thread():
    @cuda.jit
    def fails(out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        if i == 3:
            out[100] = 1  # out of bounds
        cuda.syncthreads()
        out[i] = i

    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\]"):
        fails[1, 8](np.zeros(8, np.int32))


def test_the_fast_scalar_casts_answer_as_the_stock_ones():
    """tests/cudasim_casts.py: every cast it answers itself gives the stock call's value and type,
    or raises the stock call's exception; signatures still go to the stock method."""
    from numba import types
    from numba.core.types import abstract

    assert getattr(abstract.Type, "_vmstoolkit_casts", False)
    stock = abstract.Type._vmstoolkit_stock_call
    values = [0, 1, -1, 3.7, -2.5, 2**31, -2**40, 2**64, True, float("inf"), float("nan"), 1e40,
              np.int8(-3), np.uint16(65535), np.int64(-2**62), np.float16(1.5), np.float32(-0.0),
              np.float64(2.5e-320), np.bool_(True), np.uint64(2**64 - 1)]
    for ty in (*types.integer_domain, *types.real_domain, types.boolean):
        for x in values:
            def outcome(call):
                try:
                    with np.errstate(all="ignore"):
                        r = call(ty, x)
                    return type(r), repr(r)
                except Exception as e:  # noqa: BLE001 - the exception's type is what is compared
                    return type(e), None
            assert outcome(type(ty).__call__) == outcome(stock), (ty, x)
    assert types.int32(types.int32, types.float32) == stock(types.int32, types.int32, types.float32)


@cuda.jit(device=True)
def _lane_here():
    return cuda.threadIdx.x


def test_device_functions_of_the_kernels_module_and_of_another_see_the_simulated_cuda():
    """tests/cudasim_device_calls.py: a device function beside the kernel is called directly, one
    of another module through the stock swap; both read the simulated thread index, and both
    modules get the real ``cuda`` back after the launch."""
    from numba.cuda.simulator import kernel as K

    assert getattr(K.FakeCUDAKernel, "_vmstoolkit_device_calls", False)
    other = {}
    exec("from numba import cuda\n@cuda.jit(device=True)\ndef lane():\n    return cuda.threadIdx.x * 10\n", other)
    lane_there = other["lane"]

    @cuda.jit
    def both(out):
        i = cuda.threadIdx.x
        out[i, 0] = _lane_here()
        out[i, 1] = lane_there()

    out = np.zeros((6, 2), np.int32)
    both[1, 6](out)
    assert out.tolist() == [[i, 10 * i] for i in range(6)]
    import sys

    real = sys.modules["numba.cuda"]
    assert globals()["cuda"] is real and other["cuda"] is real


def test_shared_arrays_are_keyed_by_the_calling_line_as_the_stock_ones():
    """tests/cudasim_shared.py: the arrays come back keyed by the same (file, line) as the stock
    method's (the same line: one array, whatever the thread; two lines: two), and dynamic shared
    memory and the alignment refusal are the stock method's."""
    from numba import float32
    from numba.cuda.simulator import kernelapi as K

    assert getattr(K.FakeCUDAShared, "_vmstoolkit_shared", False)
    stock = K.FakeCUDAShared._vmstoolkit_stock_array
    fast, ref = K.FakeCUDAShared(64), K.FakeCUDAShared(64)

    def two_lines(s, array):
        a = array(s, (2, 3), float32)
        b = array(s, 4, np.int32)
        return a, b

    got = [two_lines(fast, K.FakeCUDAShared.array) for _ in range(3)]
    want = two_lines(ref, stock)
    assert all(g[0] is got[0][0] and g[1] is got[0][1] for g in got) and got[0][0] is not got[0][1]
    assert [k[1] for k in fast._allocations] == [k[1] for k in ref._allocations]  # the same lines
    assert {k[0] for k in fast._allocations} == {k[0] for k in ref._allocations} == {__file__}
    for g, w in zip(got[0], want):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
    dyn = fast.array(0, np.dtype(np.float32))
    assert dyn.shape == (16,) and dyn.base is not None
    with pytest.raises(RuntimeError, match="alignment"):
        fast.array((4,), np.float32, alignment=16)


def test_threads_run_block_after_block_and_a_failed_blocks_threads_are_not_reused():
    """tests/cudasim_barrier.py keeps a block shape's threads: every block of a launch, and the
    next launch, runs on the same threads, each block with its own blockIdx; after a thread's
    exception that block's threads are retired and the next launch starts new ones."""
    import threading

    seen = []

    @cuda.jit
    def where(out, fail_at):
        i, b = cuda.threadIdx.x, cuda.blockIdx.x
        seen.append((b, i, threading.current_thread()))
        cuda.syncthreads()
        if b == fail_at and i == 1:
            out[100, 0] = 1  # out of bounds
        out[b, i] = b * 10 + i

    def launch(fail_at=-1):
        seen.clear()
        out = np.zeros((3, 5), np.int32)
        where[3, 5](out, fail_at)
        assert out.tolist() == [[b * 10 + i for i in range(5)] for b in range(3)]
        return {(b, i): t for b, i, t in seen}

    first = launch()
    assert len(first) == 15 and len(set(first.values())) == 5
    assert all(first[b, i] == first[0, i] for b in range(3) for i in range(5))
    assert launch() == first
    with pytest.raises(IndexError, match=r"tid=\[1, 0, 0\] ctaid=\[1, 0, 0\]"):
        where[3, 5](np.zeros((3, 5), np.int32), 1)
    after = launch()
    assert not {id(t) for t in after.values()} & {id(t) for t in first.values()}  # first's still referenced


def test_a_launched_modules_scalar_types_are_numpys_constructors_for_the_launch():
    """tests/cudasim_casts.py: while a module's kernel runs, its ``float32``/``uint64``/``int32``
    globals are the numpy constructors that the stock casts return from (same values, same
    types), its other globals untouched; after the launch they are numba's types again."""
    import numba

    mod = {"seen": [], "nothing": None}  # a None global stays None (not taken for a type)
    exec("from numba import cuda, float32, uint64, int32, boolean\n"
         "@cuda.jit\n"
         "def k(out):\n"
         "    seen.append((float32, uint64, int32, boolean, nothing))\n"
         "    i = cuda.threadIdx.x\n"
         "    out[i] = float32(2.5) * float32(uint64(i) + int32(1))\n", mod)
    out = np.zeros(3, np.float32)
    mod["k"][1, 3](out)
    assert out.tolist() == [2.5, 5.0, 7.5]
    assert set(mod["seen"]) == {(np.float32, np.uint64, np.int32, numba.boolean, None)}
    assert (mod["float32"], mod["uint64"], mod["int32"]) == (numba.float32, numba.uint64, numba.int32)
    assert mod["cuda"] is sys.modules["numba.cuda"]


def test_device_functions_a_kernel_closes_over_are_its_python_functions_for_the_launch():
    """tests/cudasim_device_calls.py: device functions made in a factory beside the kernel (as
    make_gemm's) are reached through closure cells; for the launch those cells hold the Python
    functions (what the direct call would run), nested ones too, and afterwards the device
    functions again."""
    from numba.cuda.simulator import kernel as K

    seen = []

    def make():
        @cuda.jit(device=True)
        def inner(i):
            return cuda.threadIdx.x + i

        @cuda.jit(device=True)
        def outer(i):
            seen.append((type(inner), type(outer_ref[0])))
            return inner(i) * 2

        outer_ref = [outer]

        @cuda.jit
        def k(out):
            out[cuda.threadIdx.x] = outer(1)

        return k, inner, outer

    k, inner, outer = make()
    out = np.zeros(4, np.int32)
    k[1, 4](out)
    assert out.tolist() == [2, 4, 6, 8]
    assert set(seen) == {(type(inner.py_func), K.FakeCUDAKernel)}  # cells swapped, a list's item not
    cells = [c.cell_contents for f in (k.py_func, outer.py_func) for c in f.__closure__]
    assert any(v is inner for v in cells) and any(v is outer for v in cells)
    assert not any(v is inner.py_func or v is outer.py_func for v in cells)  # put back


def test_in_kernel_indexing_gives_what_the_stock_wrappers_give():
    """tests/cudasim_arrays.py: elements, rows, slices and records read and written through the
    in-kernel array as through the stock wrappers: the same values and types, writes landing."""
    from numba.cuda.simulator.cudadrv import devicearray as D

    W = D.FakeWithinKernelCUDAArray
    assert getattr(W, "_vmstoolkit_arrays", False)
    stock_get, stock_set = W._vmstoolkit_stock
    rec = np.zeros(3, dtype=[("a", np.int32), ("b", np.float32)])
    for base in (np.arange(24, dtype=np.float32).reshape(4, 6), rec):
        fast, ref = W(D.FakeCUDAArray(base.copy(), stream=5)), W(D.FakeCUDAArray(base.copy(), stream=5))
        for idx in ((1, 2), 1, (slice(1, 3), 2), -1, (Ellipsis,), 0) if base.ndim == 2 else (0, 2, slice(0, 2)):
            got, want = fast[idx], stock_get(ref, idx)
            assert type(got) is type(want)
            if isinstance(got, W):
                assert type(got._item) is D.FakeCUDAArray and got._item.stream == want._item.stream == 5
                got, want = got._item._ary, want._item._ary
            assert np.array_equal(got, want) and np.asarray(got).dtype == np.asarray(want).dtype
        i = (2, 3) if base.ndim == 2 else 1
        v = np.float32(7) if base.ndim == 2 else (4, 2.5)
        fast[i] = v
        stock_set(ref, i, v)
        assert np.array_equal(fast._item._ary, ref._item._ary)
    with pytest.raises(IndexError):
        W(D.FakeCUDAArray(np.zeros(3)))[5]
