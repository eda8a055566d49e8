"""GEMM ``y = x @ w.T`` (the ``nn.Linear`` layout): x (M, K), w (N, K), y (M, N), float32.

Recipe: the numpy reference (``reference.linear``), two register-blocked kernels, a launcher that
picks the tile shape, and ``validate()`` against the reference over several shapes.

Register blocking: a block of ``(bm // tm) * (bn // tn)`` threads computes a ``bm x bn`` tile of y.
Each step it stages a ``bk``-deep slice of x and of w in shared memory (stored k-major, so the
inner loop reads rows of both), and every thread accumulates a ``tm x tn`` micro-tile in registers
(``cuda.local.array`` with compile-time sizes; NVVM unrolls the loops and keeps it in registers).
Per k step a thread does ``tm + tn`` shared loads for ``tm * tn`` FMAs, instead of 2 loads per FMA
in the one-output-per-thread kernel.

A thread owns the rows ``ty + i * (bm // tm)`` and the columns ``tx + j * (bn // tn)`` (strided,
not a contiguous 8x8 patch): neighbouring threads then read neighbouring shared-memory words
(no bank conflicts without vector loads, which Numba does not emit) and write neighbouring
columns of y (coalesced stores).

- ``gemm_v1``: one shared buffer, two barriers per k step.
- ``gemm_v2``: two shared buffers; the next slice is fetched from global memory into registers
  while the current one is multiplied, then stored into the other buffer: one barrier per k step
  and the global-load latency hidden behind the FMAs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from . import reference
from ._util import check_float32, check_ndim, simulating


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape of the register-blocked GEMM. Defaults: the classic shape, 128 x 128 outputs
    per block, 256 threads each holding an 8 x 8 micro-tile (64 accumulators, within the
    255-register budget), k slices of 16 (2 x 16 x 132 x 4 bytes = 16.5 KiB of shared memory).
    The launcher picks from ``GPU_TILES`` (measured) instead."""

    bm: int = 128  # rows of y per block
    bn: int = 128  # columns of y per block
    bk: int = 16  # depth of the k slice staged in shared memory
    tm: int = 8  # rows per thread
    tn: int = 8  # columns per thread

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def check(self) -> None:
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"tile {self} : bm % tm and bn % tn must be 0")
        t = self.threads
        if (self.bm * self.bk) % t or (self.bn * self.bk) % t:
            raise ValueError(
                f"tile {self}: bm*bk={self.bm * self.bk} and bn*bk={self.bn * self.bk} must be "
                f"multiples of the {t} threads"
            )
        if t > 1024:
            raise ValueError(f"tile {self} needs {t} threads per block (> 1024)")


# Tiny tiles for the CPU simulator: 16 threads, each a 2 x 2 micro-tile (same code path).
SIM_TILES = GemmTiles(bm=8, bn=8, bk=4, tm=2, tn=2)
# Shared-memory row padding: with bk = 8, a warp stores 8 k-rows x 4 m-columns of the x slice;
# padding rows to bm + 4 words puts those 32 stores in 32 distinct banks (2-way with bk = 16).
PAD = 4


def make_gemm_v1(t: GemmTiles):
    """One shared buffer, ``syncthreads`` before and after each k step."""
    t.check()
    BM, BN, BK, TM, TN = t.bm, t.bn, t.bk, t.tm, t.tn
    NTX, NTY = BN // TN, BM // TM
    NT = NTX * NTY
    A_LOADS, B_LOADS = BM * BK // NT, BN * BK // NT
    BMP, BNP = BM + PAD, BN + PAD

    @cuda.jit
    def gemm_v1(x, w, y):
        M, K = x.shape
        N = w.shape[0]
        As = cuda.shared.array((BK, BMP), float32)  # (bk, bm) slice of x, k-major
        Bs = cuda.shared.array((BK, BNP), float32)  # (bk, bn) slice of w, k-major
        acc = cuda.local.array((TM, TN), float32)  # (tm, tn) micro-tile
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TN, float32)
        tid = cuda.threadIdx.x
        tx = tid % NTX
        ty = tid // NTX
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        for k0 in range(0, K, BK):
            for l in range(A_LOADS):
                e = tid + l * NT
                r = e // BK
                c = e % BK
                v = float32(0.0)
                if m0 + r < M and k0 + c < K:
                    v = x[m0 + r, k0 + c]
                As[c, r] = v
            for l in range(B_LOADS):
                e = tid + l * NT
                r = e // BK
                c = e % BK
                v = float32(0.0)
                if n0 + r < N and k0 + c < K:
                    v = w[n0 + r, k0 + c]
                Bs[c, r] = v
            cuda.syncthreads()
            for kk in range(BK):
                for i in range(TM):
                    a_reg[i] = As[kk, ty + i * NTY]
                for j in range(TN):
                    b_reg[j] = Bs[kk, tx + j * NTX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_reg[i] * b_reg[j]
            cuda.syncthreads()
        for i in range(TM):
            r = m0 + ty + i * NTY
            if r < M:
                for j in range(TN):
                    c = n0 + tx + j * NTX
                    if c < N:
                        y[r, c] = acc[i, j]

    return gemm_v1


def make_gemm_v2(t: GemmTiles):
    """Double-buffered shared memory with a register prefetch of the next k slice."""
    t.check()
    BM, BN, BK, TM, TN = t.bm, t.bn, t.bk, t.tm, t.tn
    NTX, NTY = BN // TN, BM // TM
    NT = NTX * NTY
    A_LOADS, B_LOADS = BM * BK // NT, BN * BK // NT
    BMP, BNP = BM + PAD, BN + PAD

    @cuda.jit
    def gemm_v2(x, w, y):
        M, K = x.shape
        N = w.shape[0]
        As = cuda.shared.array((2, BK, BMP), float32)  # 2 x (bk, bm) slices of x
        Bs = cuda.shared.array((2, BK, BNP), float32)  # 2 x (bk, bn) slices of w
        acc = cuda.local.array((TM, TN), float32)  # (tm, tn)
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TN, float32)
        a_pf = cuda.local.array(A_LOADS, float32)  # prefetched part of the next x slice
        b_pf = cuda.local.array(B_LOADS, float32)
        tid = cuda.threadIdx.x
        tx = tid % NTX
        ty = tid // NTX
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        n_steps = (K + BK - 1) // BK
        # slice 0 straight into buffer 0
        for l in range(A_LOADS):
            e = tid + l * NT
            r = e // BK
            c = e % BK
            v = float32(0.0)
            if m0 + r < M and c < K:
                v = x[m0 + r, c]
            As[0, c, r] = v
        for l in range(B_LOADS):
            e = tid + l * NT
            r = e // BK
            c = e % BK
            v = float32(0.0)
            if n0 + r < N and c < K:
                v = w[n0 + r, c]
            Bs[0, c, r] = v
        cuda.syncthreads()
        for s in range(n_steps):
            cur = s % 2
            k1 = (s + 1) * BK
            has_next = s + 1 < n_steps
            if has_next:
                for l in range(A_LOADS):
                    e = tid + l * NT
                    r = e // BK
                    c = e % BK
                    v = float32(0.0)
                    if m0 + r < M and k1 + c < K:
                        v = x[m0 + r, k1 + c]
                    a_pf[l] = v
                for l in range(B_LOADS):
                    e = tid + l * NT
                    r = e // BK
                    c = e % BK
                    v = float32(0.0)
                    if n0 + r < N and k1 + c < K:
                        v = w[n0 + r, k1 + c]
                    b_pf[l] = v
            for kk in range(BK):
                for i in range(TM):
                    a_reg[i] = As[cur, kk, ty + i * NTY]
                for j in range(TN):
                    b_reg[j] = Bs[cur, kk, tx + j * NTX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_reg[i] * b_reg[j]
            if has_next:
                # Buffer 1 - cur was last read in step s - 1, which every thread finished
                # before the barrier that ended that step.
                nxt = 1 - cur
                for l in range(A_LOADS):
                    e = tid + l * NT
                    As[nxt, e % BK, e // BK] = a_pf[l]
                for l in range(B_LOADS):
                    e = tid + l * NT
                    Bs[nxt, e % BK, e // BK] = b_pf[l]
            cuda.syncthreads()
        for i in range(TM):
            r = m0 + ty + i * NTY
            if r < M:
                for j in range(TN):
                    c = n0 + tx + j * NTX
                    if c < N:
                        y[r, c] = acc[i, j]

    return gemm_v2


VARIANTS = {1: make_gemm_v1, 2: make_gemm_v2}
# Measured on the H200 (experiments/results/kernels_bench_h200_sweep.txt): v1 beat v2 on every
# tile shape (18.6 vs 16.1 TFLOP/s best at 4096^3). v2's extra buffer index and prefetch
# registers cost more than the barrier it saves, at these occupancies.
DEFAULT_VARIANT = 1

# GPU tile candidates, first that gives a full wave wins. Measured with v1 on the H200, TFLOP/s
# (experiments/results/kernels_bench_h200_sweep*.txt; cuBLAS fp32 42-48 at these shapes):
#                 4096^3  1024x2048x2048  1024x5632x2048  1024x2048x5632  1024x512x2048
#   64x128x8/4x8   18.5        16.9            16.7            17.6            6.2
#   128x128x16/8x8 17.8        17.2            15.5            17.1            4.7
#   64x128x16/4x8  12.5        13.0            11.3            12.5            6.7
#   64x64x16/4x4   14.9        13.8            13.8            14.6            9.2
#   128x128x8/8x8   9.5        10.4             8.5             9.1            2.8
# (bk = 8 pays two barriers per 8-deep step; with 128 x 128 tiles bk = 16 amortises them, with
# 64 x 128 tiles it does not help.)
GPU_TILES = (
    GemmTiles(bm=64, bn=128, bk=8, tm=4, tn=8),  # 256 threads, 4 x 8 micro-tile
    GemmTiles(bm=64, bn=64, bk=16, tm=4, tn=4),  # 256 threads, for small N (GQA k/v proj)
)
# A launch below this many blocks leaves SMs idle (the H200 has 132).
MIN_BLOCKS = 132


@lru_cache(maxsize=None)
def get_kernel(variant: int, tiles: GemmTiles):
    if variant not in VARIANTS:
        raise ValueError(f"unknown GEMM variant {variant}; known: {sorted(VARIANTS)}")
    return VARIANTS[variant](tiles)


def choose_tiles(m: int, n: int, k: int) -> GemmTiles:
    """Launch shape for an (m, n, k) problem. Under the simulator: the tiny tiles. On the GPU:
    the largest candidate tile that still gives at least one block per SM."""
    if simulating():
        return SIM_TILES
    for t in GPU_TILES:
        if -(-m // t.bm) * -(-n // t.bn) >= MIN_BLOCKS:
            return t
    return GPU_TILES[-1]


def check_args(x, w, y) -> tuple[int, int, int]:
    for name, a in (("x", x), ("w", w), ("y", y)):
        check_ndim(name, a, 2)
        check_float32(name, a)
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"linear: x is (M={m}, K={k}) but w is (N={n}, K={kw}); K must match")
    if tuple(y.shape) != (m, n):
        raise ValueError(f"linear: output has shape {tuple(y.shape)}, expected (M={m}, N={n})")
    return m, n, k


def gemm(x, w, y, stream=0, tiles: GemmTiles | None = None, variant: int = DEFAULT_VARIANT):
    """Enqueue ``y = x @ w.T`` on ``stream``. x (M, K), w (N, K), y (M, N): device arrays."""
    m, n, k = check_args(x, w, y)
    tiles = tiles or choose_tiles(m, n, k)
    kernel = get_kernel(variant, tiles)
    grid = (-(-n // tiles.bn), -(-m // tiles.bm))
    kernel[grid, tiles.threads, stream](x, w, y)


def validate(
    shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8)),
    tiles: GemmTiles | None = None,
    variants=tuple(VARIANTS),
    rtol: float = 1e-5,
    seed: int = 0,
) -> list[dict]:
    """Run every variant on each (M, N, K) against ``reference.linear``; returns one record per
    run with the max error relative to the reference's largest magnitude. Raises on a mismatch."""
    rng = np.random.default_rng(seed)
    records = []
    for m, n, k in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)  # (M, K)
        w = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        want = reference.linear(x, w)  # (M, N)
        for v in variants:
            d_y = cuda.device_array((m, n), dtype=np.float32)  # (M, N)
            gemm(cuda.to_device(x), cuda.to_device(w), d_y, tiles=tiles, variant=v)
            got = d_y.copy_to_host()
            err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
            records.append({"shape": (m, n, k), "variant": v, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"gemm_v{v} at (M,N,K)={(m, n, k)}: max rel err {err:.3g}")
    return records
