"""The simulator's scheduler as tests/conftest.py installs it (tests/cudasim_barrier.py): the
barrier, early-exiting threads, the counting barriers and a thread's exception behave as the
stock simulator's. Every kernel test runs on it too."""

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
