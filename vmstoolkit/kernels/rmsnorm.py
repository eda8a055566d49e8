"""RMSNorm over the last axis: ``y = x / sqrt(mean(x**2) + eps) * w``; x (R, H), w (H,), float32.

Recipe: the numpy reference (``reference.rmsnorm``), the kernel, a launcher, ``validate()``.

One block per row: the threads stride over the row summing squares, a shared-memory tree
reduction gives the mean, then the same threads write the scaled row. x is read twice; the
second read hits L1/L2 at the block's sizes (a 2048-float row is 8 KiB).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from . import reference
from ._util import check_float32, check_ndim, check_shape, simulating

# Threads per row: 256 on a GPU (8 per element of a 2048-wide row), 8 under the simulator.
THREADS_GPU = 256
THREADS_SIM = 8


@lru_cache(maxsize=None)
def make_rmsnorm_kernel(threads: int):
    if threads & (threads - 1):
        raise ValueError(f"rmsnorm threads per block must be a power of two, got {threads}")

    @cuda.jit
    def rmsnorm_kernel(x, w, y, eps):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        h = x.shape[1]
        part = cuda.shared.array(threads, float32)  # (threads,) partial sums of squares
        s = float32(0.0)
        for c in range(tid, h, threads):
            v = x[row, c]
            s += v * v
        part[tid] = s
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if tid < stride:
                part[tid] += part[tid + stride]
            cuda.syncthreads()
            stride //= 2
        inv = float32(1.0) / math.sqrt(part[0] / float32(h) + eps)
        for c in range(tid, h, threads):
            y[row, c] = (x[row, c] * inv) * w[c]

    return rmsnorm_kernel


def check_args(x, w, y) -> tuple[int, int]:
    for name, a in (("x", x), ("w", w), ("y", y)):
        check_float32(name, a)
    check_ndim("x", x, 2)
    r, h = x.shape
    check_shape("rmsnorm weight", w, (h,))
    check_shape("rmsnorm output", y, (r, h))
    return r, h


def rmsnorm(x, w, y, eps: float = 1e-6, stream=0, threads: int | None = None):
    """Enqueue RMSNorm of the rows of x (R, H) with weight w (H,) into y (R, H)."""
    r, _ = check_args(x, w, y)
    threads = threads or (THREADS_SIM if simulating() else THREADS_GPU)
    if r == 0:
        return
    make_rmsnorm_kernel(threads)[r, threads, stream](x, w, y, np.float32(eps))


def validate(shapes=((1, 8), (3, 5), (4, 33), (2, 7)), eps: float = 1e-6, rtol: float = 1e-5,
             seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for r, h in shapes:
        x = rng.standard_normal((r, h), dtype=np.float32)  # (R, H)
        w = rng.standard_normal(h, dtype=np.float32)  # (H,)
        want = reference.rmsnorm(x, w, eps)  # (R, H)
        d_y = cuda.device_array((r, h), dtype=np.float32)
        rmsnorm(cuda.to_device(x), cuda.to_device(w), d_y, eps)
        got = d_y.copy_to_host()
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        records.append({"shape": (r, h), "max_rel_err": err})
        if not err <= rtol:
            raise AssertionError(f"rmsnorm at (R,H)={(r, h)}: max rel err {err:.3g}")
    return records
