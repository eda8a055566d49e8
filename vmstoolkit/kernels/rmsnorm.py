"""RMSNorm over the last axis: ``y = x / sqrt(mean(x**2) + eps) * w``; x (R, H), w (H,), float32.

Recipe: the numpy reference (``reference.rmsnorm``), the kernel, a launcher, ``validate()``.

One block per row: the threads stride over the row summing squares, a shared-memory tree
reduction gives the mean, then the same threads write the scaled row. x is read twice; the
second read hits L1/L2 at the block's sizes (a 2048-float row is 8 KiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, check_ndim, check_shape, simulating

# Threads per row: 256 on a GPU (8 per element of a 2048-wide row), 8 under the simulator.
THREADS_GPU = 256
THREADS_SIM = 8


@lru_cache(maxsize=None)
def make_block_sum(threads: int):
    """A device function: the sum over a block of ``threads`` threads of each thread's ``v``, by a
    shared-memory tree reduction in ``part`` (``threads`` floats), which is free again on return."""
    if threads & (threads - 1):
        raise KernelError(f"rmsnorm threads per block must be a power of two, got {threads}")

    @cuda.jit(device=True)
    def block_sum(part, tid, v):
        part[tid] = v
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if tid < stride:
                part[tid] += part[tid + stride]
            cuda.syncthreads()
            stride //= 2
        total = part[0]
        cuda.syncthreads()  # part is reused by the next reduction
        return total

    return block_sum


@lru_cache(maxsize=None)
def make_rmsnorm_kernel(threads: int):
    block_sum = make_block_sum(threads)

    @fastlaunch.jit
    def rmsnorm_kernel(x, w, y, eps):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        h = x.shape[1]
        part = cuda.shared.array(threads, float32)  # (threads,) partial sums of squares
        s = float32(0.0)
        for c in range(tid, h, threads):
            v = x[row, c]
            s += v * v
        inv = float32(1.0) / math.sqrt(block_sum(part, tid, s) / float32(h) + eps)
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


# ---- backward -------------------------------------------------------------------------------
# dx (one block per row, like the forward): r = 1/sqrt(mean(x^2) + eps), g = dy * w,
# dx = r * (g - x r * mean(g * x r)). Two block reductions (sum x^2, sum g x), then the write.
#
# Note [rmsnorm dw]
# -----------------
# Rationale. ``dw[c] = sum_r dy[r, c] x[r, c] r_r`` is a reduction over rows for every column, and
# each row's factor ``r_r`` needs that whole row. The first kernel gave a block of 256 threads 256
# columns and walked the rows one at a time, the block recomputing each row's r_r by a tree
# reduction (8 barriers per row): 16 blocks at H = 4096, each 2048 rows of latency-bound steps,
# 5.7 ms per call at (R, H) = (2048, 4096) on the H200 (0.18 s of a full fine-tuning step).
# Approach. A block of ``col_lanes x row_lanes`` threads owns ``col_lanes * cols`` adjacent
# columns and walks the rows ``rows`` at a time. For each batch it first computes the batch's
# r_r: every thread sums the squares of ``rows / row_lanes`` rows at once over the columns
# ``col_lanes`` apart (one warp reads 128 adjacent bytes of a row per load; ``unroll`` such loads
# per row per loop trip, so that ``rows / row_lanes * unroll`` loads are in flight per thread), and
# the ``col_lanes`` partial sums of a row are added in shared memory in a fixed order. Then each
# thread adds ``dy * x * r_r`` of its columns over rows ``row_lanes`` apart into registers. At the
# end the ``row_lanes`` partial sums of a column are added in a fixed order (then ``acc``): no
# atomics, so the result is the same on every run at one tile shape.
# Limitations. The task has no scratch memory (the runtime budgets every buffer and the task's
# buffers are x, dy, acc and dw), so r_r cannot be computed once and shared between blocks: each
# block reads all of x once for the row factors, H / (col_lanes * cols) times x in all (32x at
# H = 4096 with the GPU tiles), mostly from L2 (x is 32 MB at (2048, 4096)). What bounds the
# kernel is the L2 -> SM bandwidth of one SM (~120 GB/s at 64 bytes per clock: an estimate, not
# yet measured): ~0.3 ms at (2048, 4096), against ~17 us for reading x and dy once from HBM
# (``experiments/kernels_bench.py --only rmsnorm`` times it, with other tiles). Reaching that needs the row factors as an input (a (R,)
# tensor written by rmsnorm_dx, which computes them anyway) or a cooperative launch that keeps
# them in dw between two grid barriers; both change more than this kernel.


@dataclass(frozen=True)
class DwTiles:
    """Thread layout of :func:`rmsnorm_backward_dw` (Note [rmsnorm dw])."""

    col_lanes: int = 32  # threads along a row: a warp's load is 32 adjacent floats (128 bytes)
    row_lanes: int = 16  # threads along the columns: 512 threads (at 80 registers, 1024 would not fit an SM)
    cols: int = 4  # columns per thread, col_lanes apart: 128 per block, 32 blocks at H = 4096
    rows: int = 32  # rows per batch: 2 rows per thread summed at once in the row-factor pass
    unroll: int = 4  # loads per row per trip of the row-factor loop (8 per thread, NVVM unrolls it to 16)

    @property
    def threads(self) -> int:
        return self.col_lanes * self.row_lanes

    @property
    def span(self) -> int:
        """Columns per block."""
        return self.col_lanes * self.cols

    def check(self) -> None:
        if min(self.col_lanes, self.row_lanes, self.cols, self.rows, self.unroll) < 1:
            raise KernelError(f"rmsnorm dw tiles {self}: every field must be at least 1")
        if self.rows % self.row_lanes or self.rows > self.threads or self.threads > 1024:
            raise KernelError(f"rmsnorm dw tiles {self}: rows must be a multiple of row_lanes and at most "
                              f"col_lanes * row_lanes threads, which are at most 1024")


DW_TILES_GPU = DwTiles()
# Under the simulator every thread is an OS thread: 8 threads, a span of 8 columns, 4-row batches.
DW_TILES_SIM = DwTiles(col_lanes=4, row_lanes=2, cols=2, rows=4, unroll=2)


@lru_cache(maxsize=None)
def make_rmsnorm_dx_kernel(threads: int):
    block_sum = make_block_sum(threads)

    @fastlaunch.jit
    def rmsnorm_dx_kernel(x, w, dy, dx, eps):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        h = x.shape[1]
        part = cuda.shared.array(threads, float32)
        s = float32(0.0)
        sg = float32(0.0)
        for c in range(tid, h, threads):
            v = x[row, c]
            s += v * v
            sg += dy[row, c] * w[c] * v
        inv = float32(1.0) / math.sqrt(block_sum(part, tid, s) / float32(h) + eps)
        coef = block_sum(part, tid, sg) * inv / float32(h)  # mean(g * x r)
        for c in range(tid, h, threads):
            dx[row, c] = inv * (dy[row, c] * w[c] - x[row, c] * inv * coef)

    return rmsnorm_dx_kernel


@lru_cache(maxsize=None)
def make_rmsnorm_dw_kernel(t: DwTiles):
    """``kernel(x, dy, acc, dw, eps, accumulate)`` on a grid of ``ceil(H / t.span)`` blocks of
    ``(t.col_lanes, t.row_lanes)`` threads (Note [rmsnorm dw])."""
    t.check()
    CL, RL, K, RB, U = t.col_lanes, t.row_lanes, t.cols, t.rows, t.unroll
    RPT = RB // RL  # rows per thread in a batch
    SPAN = t.span
    # ptxas gives the GPU tiles 72-96 registers (sm_90, offline): cap them so that a block fits an
    # SM's 64 Ki registers whatever the JIT does (the simulator takes no such option)
    opts = {} if simulating() else {"max_registers": min(255, 65536 // t.threads // 8 * 8)}

    @cuda.jit(device=True, inline="always")
    def row_factors(x, base, nb, cl, rl, part, inv, eps):
        """inv[i] = 1 / sqrt(mean(x[base + i]^2) + eps) for i < nb, 0 for nb <= i < RB; called by
        every thread of the block."""
        r_, h = x.shape
        s = cuda.local.array(RPT, float32)
        rows = cuda.local.array(RPT, uint64)
        for j in range(RPT):
            s[j] = float32(0.0)
            rows[j] = uint64(min(base + rl + RL * j, r_ - 1))  # rows past the end: never used
        full = h // (CL * U) * (CL * U)
        for q in range(0, full, CL * U):  # U loads per row per trip, no bounds checks
            for u in range(U):
                c = uint64(q + cl + CL * u)
                for j in range(RPT):
                    v = x[rows[j], c]
                    s[j] += v * v
        for c in range(full + cl, h, CL):
            for j in range(RPT):
                v = x[rows[j], uint64(c)]
                s[j] += v * v
        for j in range(RPT):
            part[rl + RL * j, cl] = s[j]
        cuda.syncthreads()
        tid = rl * CL + cl
        if tid < RB:
            f = float32(0.0)
            if tid < nb:
                tot = float32(0.0)
                for k in range(CL):  # a fixed order
                    tot += part[tid, k]
                f = float32(1.0) / math.sqrt(tot / float32(h) + eps)
            inv[tid] = f
        cuda.syncthreads()

    @fastlaunch.jit(**opts)
    def rmsnorm_dw_kernel(x, dy, acc, dw, eps, accumulate):
        cl = cuda.threadIdx.x
        rl = cuda.threadIdx.y
        c0 = cuda.blockIdx.x * SPAN
        r_, h = x.shape
        part = cuda.shared.array((RB, CL), float32)  # a batch's partial sums of squares
        inv = cuda.shared.array(RB, float32)  # the batch's row factors
        red = cuda.shared.array((RL, SPAN), float32)  # the row lanes' column sums
        tot = cuda.local.array(K, float32)
        cols = cuda.local.array(K, uint64)
        for k in range(K):
            tot[k] = float32(0.0)
            cols[k] = uint64(min(c0 + cl + CL * k, h - 1))  # columns past the end: never written
        for base in range(0, r_, RB):
            nb = min(RB, r_ - base)
            # part and inv are rewritten only after row_factors' first barrier, which every
            # thread reaches after its reads of the previous batch: no barrier needed here
            row_factors(x, base, nb, cl, rl, part, inv, eps)
            for j in range(RPT):
                i = rl + RL * j
                f = inv[i]  # 0 past the last row, whose clamped loads add 0
                r = uint64(min(base + i, r_ - 1))
                for k in range(K):
                    tot[k] += dy[r, cols[k]] * x[r, cols[k]] * f
        for k in range(K):
            red[rl, cl + CL * k] = tot[k]
        cuda.syncthreads()
        if rl == 0:
            for k in range(K):
                c = c0 + cl + CL * k
                if c < h:
                    s = red[0, cl + CL * k]
                    for j in range(1, RL):  # a fixed order
                        s += red[j, cl + CL * k]
                    if accumulate:
                        s += acc[c]
                    dw[c] = s

    return rmsnorm_dw_kernel


def rmsnorm_backward_dx(x, w, dy, dx, eps: float = 1e-6, stream=0, threads: int | None = None):
    """Enqueue ``dx`` of RMSNorm: x, dy, dx (R, H), w (H,)."""
    r, h = check_args(x, w, dx)
    check_float32("dy", dy)
    check_shape("rmsnorm dy", dy, (r, h))
    threads = threads or (THREADS_SIM if simulating() else THREADS_GPU)
    if r == 0:
        return
    make_rmsnorm_dx_kernel(threads)[r, threads, stream](x, w, dy, dx, np.float32(eps))


def rmsnorm_backward_dw(x, dy, dw, eps: float = 1e-6, stream=0, acc=None, tiles: DwTiles | None = None):
    """Enqueue ``dw = sum_rows dy * x / rms(x)`` (+ ``acc``, which may be ``dw`` itself): x, dy
    (R, H), dw and acc (H,). Deterministic: the same bits on every run (Note [rmsnorm dw]).
    Cost: x read ``ceil(H / tiles.span)`` times (mostly from L2), dy once."""
    for name, a in (("x", x), ("dy", dy), ("dw", dw)):
        check_float32(name, a)
    check_ndim("x", x, 2)
    r, h = x.shape
    check_shape("rmsnorm dy", dy, (r, h))
    check_shape("rmsnorm dw", dw, (h,))
    if acc is not None:
        check_float32("acc", acc)
        check_shape("rmsnorm dw acc", acc, (h,))
    t = tiles or (DW_TILES_SIM if simulating() else DW_TILES_GPU)
    if h == 0:
        return
    make_rmsnorm_dw_kernel(t)[-(-h // t.span), (t.col_lanes, t.row_lanes), stream](
        x, dy, dw if acc is None else acc, dw, np.float32(eps), acc is not None)


def validate_backward(shapes=((1, 8), (3, 5), (4, 33), (9, 19)), eps: float = 1e-6, rtol: float = 1e-5,
                      seed: int = 0, tiles: DwTiles | None = None) -> list[dict]:
    """dx and dw against the numpy reference; dw three ways: alone, added to an ``acc``, and
    added in place (``acc`` is ``dw``). The defaults are ragged for the simulator's tiles (H not a
    multiple of the span, R not of the batch, R below it)."""
    rng = np.random.default_rng(seed)
    records = []
    for r, h in shapes:
        x = rng.standard_normal((r, h), dtype=np.float32)  # (R, H)
        w = rng.standard_normal(h, dtype=np.float32)  # (H,)
        dy = rng.standard_normal((r, h), dtype=np.float32)  # (R, H)
        acc = rng.standard_normal(h, dtype=np.float32)  # (H,)
        want_dx, want_dw = reference.rmsnorm_backward(x, w, dy, eps)
        d_dx = cuda.device_array((r, h), dtype=np.float32)
        d_x, d_dy = cuda.to_device(x), cuda.to_device(dy)
        rmsnorm_backward_dx(d_x, cuda.to_device(w), d_dy, d_dx, eps)
        d_dw, d_dw_acc, d_inplace = cuda.device_array(h, dtype=np.float32), cuda.device_array(h, np.float32), cuda.to_device(acc)
        rmsnorm_backward_dw(d_x, d_dy, d_dw, eps, tiles=tiles)
        rmsnorm_backward_dw(d_x, d_dy, d_dw_acc, eps, acc=cuda.to_device(acc), tiles=tiles)
        rmsnorm_backward_dw(d_x, d_dy, d_inplace, eps, acc=d_inplace, tiles=tiles)
        for name, got, want in (("dx", d_dx.copy_to_host(), want_dx), ("dw", d_dw.copy_to_host(), want_dw),
                                ("dw+acc", d_dw_acc.copy_to_host(), want_dw + acc),
                                ("dw+=", d_inplace.copy_to_host(), want_dw + acc)):
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            records.append({"shape": (r, h), "grad": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"rmsnorm backward {name} at (R,H)={(r, h)}: max rel err {err:.3g}")
    return records
