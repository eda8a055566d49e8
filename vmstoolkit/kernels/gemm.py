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
- ``gemm_v3``: v2's pipeline, rewritten for what Numba/NVVM emit (ptxas -v for sm_90 and SASS,
  numba-cuda 0.30.4 + CUDA 12.9 NVVM). In v1/v2 the inner k loop costs 1.9-2.2 SASS instructions
  per FFMA: NVVM unrolls the tm x tn loops but not the k loop, whose index is signed, so every
  trip recomputes shared addresses with a negative-index wraparound (shift + select), and all
  shared loads are 32-bit. v3 changes:

  * indices are ``uint64`` (Numba adds no wraparound code for unsigned indices; the casts are
    free) -- and never mixed with signed integers, which Numba would promote to float64;
  * the k slice is multiplied 4 columns per trip by an inlined device function called 4 times
    (an explicit unroll: NVVM will not unroll a loop whose body is 64 FMAs), and the two shared
    buffers are indexed by constants (two slices per trip of the outer loop), so a shared
    address is a base register plus an immediate;
  * runs of VEC adjacent rows/columns per thread (see ``VEC``) in 16-byte-aligned shared
    arrays: every shared load becomes ``LDS.128``;
  * each thread fetches adjacent k of one row of x and of w (one address, immediate offsets)
    and tiles wholly inside the matrices skip the bounds checks (block-uniform branch);
  * ``max_registers`` caps registers so that ``blocks_per_sm`` blocks fit on an SM (2 for v3).

  Result at 128x128x8/8x8: the inner loop is 256 FFMA + 16 LDS.128 + 12 others (1.11
  instructions per FFMA), 126 registers, no spills, so two 256-thread blocks per SM (v1 at this
  tile: 132 registers, one block per SM, 1.48 per FFMA with 32-bit loads).
- ``gemm_v4``: v3 without the register cap (151 registers at 128x128x8/8x8, 161 at bk = 16, no
  spills): one block per SM, for tiles whose capped build would spill.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from . import reference
from ._util import check_float32, check_ndim, simulating


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape of the register-blocked GEMM. Defaults: the classic shape, 128 x 128 outputs
    per block, 256 threads each holding an 8 x 8 micro-tile (64 accumulators, within the
    255-register budget), k slices of 16 (2 x 16 x 132 x 4 bytes = 16.5 KiB of shared memory).
    The launcher picks with :func:`choose` (measured) instead."""

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
# gemm_v3: a thread's rows (columns) come in runs of VEC adjacent ones, VEC apart per thread, so
# that NVVM's load/store vectoriser turns each run into one 128-bit shared load (ld.shared.v4).
# A warp then reads 16 runs of w (256 contiguous bytes, no conflict) and 2 runs of x (broadcast).
VEC = 4


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


def max_registers(threads: int, blocks_per_sm: int) -> int:
    """Register cap per thread that lets ``blocks_per_sm`` blocks of ``threads`` share an SM's
    64 Ki registers (allocated per warp in units of 256, i.e. 8 per thread); at most 255."""
    return min(255, 65536 // (blocks_per_sm * threads) // 8 * 8)


def make_gemm_v3(t: GemmTiles, blocks_per_sm: int = 2):
    """v2's pipeline without the inner-loop overhead; see ``gemm_v3`` in the module docstring.
    Needs bk a multiple of 4 and of the loads per thread (each thread fetches adjacent k)."""
    t.check()
    BM, BN, BK, TM, TN = t.bm, t.bn, t.bk, t.tm, t.tn
    NTX, NTY = BN // TN, BM // TM
    NT = NTX * NTY
    A_LOADS, B_LOADS = BM * BK // NT, BN * BK // NT
    if BK % 4 or BK % A_LOADS or BK % B_LOADS:
        raise ValueError(f"tile {t}: gemm_v3 needs bk a multiple of 4 and of the loads per thread "
                         f"({A_LOADS} of x, {B_LOADS} of w)")
    BMP, BNP = BM + PAD, BN + PAD
    VM = VEC if TM % VEC == 0 else 1  # a thread's rows come in runs of VM adjacent rows
    VN = VEC if TN % VEC == 0 else 1  # and its columns in runs of VN adjacent columns
    SM, SN = NTY * VM, NTX * VN  # distance between two runs of one thread
    # The simulator accepts neither option; alignment only matters to the vectoriser anyway.
    opts = {} if simulating() else {"max_registers": max_registers(NT, blocks_per_sm)}
    ALIGN = None if simulating() else 16

    @cuda.jit(device=True, inline="always")
    def k_step(As, Bs, buf, kk, ra, cb, acc, a_reg, b_reg):
        """acc += outer(x column kk, w column kk) over this thread's rows and columns."""
        for i in range(TM):
            a_reg[i] = As[buf, kk, ra + uint64((i // VM) * SM + i % VM)]
        for j in range(TN):
            b_reg[j] = Bs[buf, kk, cb + uint64((j // VN) * SN + j % VN)]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] += a_reg[i] * b_reg[j]

    @cuda.jit(device=True, inline="always")
    def multiply(As, Bs, buf, ra, cb, acc, a_reg, b_reg):
        """acc += the product of the slices in shared buffer ``buf``, 4 k columns per trip."""
        for k4 in range(0, BK, 4):
            kk = uint64(k4)
            k_step(As, Bs, buf, kk, ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(1), ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(2), ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(3), ra, cb, acc, a_reg, b_reg)

    @cuda.jit(device=True, inline="always")
    def fetch(x, w, m0, n0, k0, ar, ak, br, bk, a_pf, b_pf):
        """Registers <- this thread's share of x[m0:m0+bm, k0:k0+bk] and w[n0:n0+bn, k0:k0+bk]:
        A_LOADS (B_LOADS) adjacent k of row ar (br), zero outside the matrices. Tiles wholly
        inside a matrix skip the per-element checks (a branch taken by the whole block)."""
        M, K = uint64(x.shape[0]), uint64(x.shape[1])  # unsigned throughout: a signed / unsigned
        N = uint64(w.shape[0])  # mix would be compared in float64
        k_in = k0 + uint64(BK) <= K
        r = m0 + ar
        if k_in and m0 + uint64(BM) <= M:
            for l in range(A_LOADS):
                a_pf[l] = x[r, k0 + ak + uint64(l)]
        else:
            for l in range(A_LOADS):
                c = k0 + ak + uint64(l)
                v = float32(0.0)
                if r < M and c < K:
                    v = x[r, c]
                a_pf[l] = v
        r = n0 + br
        if k_in and n0 + uint64(BN) <= N:
            for l in range(B_LOADS):
                b_pf[l] = w[r, k0 + bk + uint64(l)]
        else:
            for l in range(B_LOADS):
                c = k0 + bk + uint64(l)
                v = float32(0.0)
                if r < N and c < K:
                    v = w[r, c]
                b_pf[l] = v

    @cuda.jit(device=True, inline="always")
    def stash(As, Bs, buf, ar, ak, br, bk, a_pf, b_pf):
        """Shared buffer ``buf`` <- the fetched registers, transposed to k-major."""
        for l in range(A_LOADS):
            As[buf, ak + uint64(l), ar] = a_pf[l]
        for l in range(B_LOADS):
            Bs[buf, bk + uint64(l), br] = b_pf[l]

    @cuda.jit(**opts)
    def gemm_v3(x, w, y, split_steps):
        # Split-K: block z multiplies k slices [z * split_steps, (z + 1) * split_steps) and adds
        # its partial tile into y (zeroed by the launcher); with one split it stores.
        M, K = x.shape
        N = w.shape[0]
        As = cuda.shared.array((2, BK, BMP), float32, alignment=ALIGN)  # 2 x (bk, bm) of x
        Bs = cuda.shared.array((2, BK, BNP), float32, alignment=ALIGN)  # 2 x (bk, bn) of w
        acc = cuda.local.array((TM, TN), float32)  # (tm, tn)
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TN, float32)
        a_pf = cuda.local.array(A_LOADS, float32)  # this thread's share of the next x slice
        b_pf = cuda.local.array(B_LOADS, float32)  # and of the next w slice
        tid = cuda.threadIdx.x
        ra = uint64((tid // NTX) * VM)  # first row of this thread's micro-tile in the block tile
        cb = uint64((tid % NTX) * VN)  # first column
        ar = uint64(tid // (BK // A_LOADS))  # row of the x slice this thread fetches
        ak = uint64(tid % (BK // A_LOADS) * A_LOADS)  # its first k
        br = uint64(tid // (BK // B_LOADS))  # same for the w slice
        bk = uint64(tid % (BK // B_LOADS) * B_LOADS)
        m0 = uint64(cuda.blockIdx.y * BM)
        n0 = uint64(cuda.blockIdx.x * BN)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        n_steps = (K + BK - 1) // BK
        s0 = cuda.blockIdx.z * split_steps  # this block's k slices: [s0, s1)
        s1 = min(n_steps, s0 + split_steps)
        fetch(x, w, m0, n0, uint64(s0 * BK), ar, ak, br, bk, a_pf, b_pf)
        stash(As, Bs, 0, ar, ak, br, bk, a_pf, b_pf)
        cuda.syncthreads()
        # Two k slices per trip so that the buffer indices are constants: slice s0 + i is in
        # buffer i % 2. A buffer is overwritten only after the barrier that ends the step reading it.
        for s in range(s0, s1, 2):
            if s + 1 < s1:
                fetch(x, w, m0, n0, uint64((s + 1) * BK), ar, ak, br, bk, a_pf, b_pf)
            multiply(As, Bs, 0, ra, cb, acc, a_reg, b_reg)
            if s + 1 < s1:
                stash(As, Bs, 1, ar, ak, br, bk, a_pf, b_pf)
            cuda.syncthreads()
            if s + 1 < s1:
                if s + 2 < s1:
                    fetch(x, w, m0, n0, uint64((s + 2) * BK), ar, ak, br, bk, a_pf, b_pf)
                multiply(As, Bs, 1, ra, cb, acc, a_reg, b_reg)
                if s + 2 < s1:
                    stash(As, Bs, 0, ar, ak, br, bk, a_pf, b_pf)
                cuda.syncthreads()
        split = cuda.gridDim.z > 1
        for i in range(TM):
            r = m0 + ra + uint64((i // VM) * SM + i % VM)
            if r < uint64(M):
                for j in range(TN):
                    c = n0 + cb + uint64((j // VN) * SN + j % VN)
                    if c < uint64(N):
                        if split:
                            cuda.atomic.add(y, (r, c), acc[i, j])
                        else:
                            y[r, c] = acc[i, j]

    return gemm_v3


def make_gemm_v4(t: GemmTiles):
    """gemm_v3 without the register cap: one 256-thread block per SM, no spills at 8 x 8."""
    return make_gemm_v3(t, blocks_per_sm=1)


VARIANTS = {1: make_gemm_v1, 2: make_gemm_v2, 3: make_gemm_v3, 4: make_gemm_v4}
SPLIT_K_VARIANTS = (3, 4)  # kernels that take the split-K argument
# Measured on the H200 (docs/results.md#kernels-h200, first sweep): v1 beat v2 on every
# tile shape (18.6 vs 16.1 TFLOP/s best at 4096^3). v2's extra buffer index and prefetch
# registers cost more than the barrier it saves, at these occupancies. v3 / v4 beat both at
# every shape (docs/results.md#kernels-h200, below).
DEFAULT_VARIANT = 3


@dataclass(frozen=True)
class GemmLaunch:
    """What the launcher runs: a variant, its tile shape, and how many k splits."""

    variant: int
    tiles: GemmTiles
    splits: int = 1


# The launch rule, from experiments/gemm_sweep.py on the H200 (docs/results.md#kernels-h200;
# % of cuBLAS fp32 with TF32 off; blocks of 128 x 128 tiles in brackets):
#                      4096^3 [1024]  1024x2048x2048 [128]  1024x5632x2048 [352]  1024x2048x5632 [128]  1024x512x2048 [32]
#   v3 128x128x8/8x8       61.4             55.6                 44.0                  53.2                 18.4
#   v4 128x128x16/8x8      57.8             60.3                 55.1                  57.1                 19.9
#   v3 64x64x16/4x4        44.1             46.4                 44.7                  43.1                 46.7
#    same, split-K 2 / 3 / 4                                                                        50.0 / 39.3 / 48.9
# v3 at 128 x 128 (two blocks per SM) wins when there are several waves of blocks; v4 (one
# deeper-k block per SM) when there are about one to three; below that the tiles must shrink,
# and 64 x 64 tiles still leave a 1024 x 512 output at 128 blocks of 8 warps: split-K
# multiplies the blocks (partial tiles added atomically into a zeroed y). Two blocks per SM
# (rounding the split count down) measured best: 3 splits leave 384 blocks, 2.9 per SM.
BIG_TILES_V3 = GemmTiles(bm=128, bn=128, bk=8, tm=8, tn=8)
BIG_TILES_V4 = GemmTiles(bm=128, bn=128, bk=16, tm=8, tn=8)
SMALL_TILES = GemmTiles(bm=64, bn=64, bk=16, tm=4, tn=4)
SM_COUNT = 132  # the H200's; it only sets the thresholds below
SPLIT_TARGET_BLOCKS = 2 * SM_COUNT  # split k up to this many blocks (two per SM)

# The v1 launch shapes (measured, kept for the earlier sweeps and the v1 tests), and the v3 / v4
# candidates that experiments/gemm_sweep.py times.
GPU_TILES = (
    GemmTiles(bm=64, bn=128, bk=8, tm=4, tn=8),  # 256 threads, 4 x 8 micro-tile
    GemmTiles(bm=64, bn=64, bk=16, tm=4, tn=4),  # 256 threads, for small N (GQA k/v proj)
)
V3_TILES = (
    BIG_TILES_V3,  # v3: 126 registers, 2 blocks per SM
    BIG_TILES_V4,  # v4: 161 registers (v3 would spill)
    GemmTiles(bm=64, bn=128, bk=8, tm=4, tn=8),  # 105 registers
    GemmTiles(bm=128, bn=64, bk=8, tm=8, tn=4),  # 109 registers
    SMALL_TILES,  # 96 registers
    GemmTiles(bm=64, bn=64, bk=32, tm=4, tn=4),  # 108 registers, 34 KiB shared memory
)


def _blocks(m: int, n: int, t: GemmTiles) -> int:
    return -(-m // t.bm) * -(-n // t.bn)


def choose(m: int, n: int, k: int, splits: int | None = None) -> GemmLaunch:
    """The launch for an (m, n, k) problem (rule and measurements above). Under the simulator:
    v3 on the tiny tiles. ``splits`` forces the small-tile path with that many k splits."""
    if simulating():
        return GemmLaunch(DEFAULT_VARIANT, SIM_TILES, splits or 1)
    big = _blocks(m, n, BIG_TILES_V3)
    if splits is None and big >= 4 * SM_COUNT:
        return GemmLaunch(3, BIG_TILES_V3)
    if splits is None and big >= SM_COUNT // 2:
        return GemmLaunch(4, BIG_TILES_V4)
    if splits is None:
        k_steps = -(-k // SMALL_TILES.bk)
        splits = max(1, min(SPLIT_TARGET_BLOCKS // _blocks(m, n, SMALL_TILES), k_steps // 8))
    return GemmLaunch(3, SMALL_TILES, splits)


def choose_tiles(m: int, n: int, k: int) -> GemmTiles:
    """The tile shape :func:`choose` picks."""
    return choose(m, n, k).tiles


@lru_cache(maxsize=None)
def get_kernel(variant: int, tiles: GemmTiles):
    if variant not in VARIANTS:
        raise ValueError(f"unknown GEMM variant {variant}; known: {sorted(VARIANTS)}")
    return VARIANTS[variant](tiles)


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


def gemm(x, w, y, stream=0, tiles: GemmTiles | None = None, variant: int | None = None,
         splits: int | None = None):
    """Enqueue ``y = x @ w.T`` on ``stream``. x (M, K), w (N, K), y (M, N): device arrays.
    Without ``tiles`` / ``variant`` the launcher picks (:func:`choose`); ``splits`` > 1 (v3 and
    v4 only) shares each tile's k slices among that many blocks, which add into a zeroed y."""
    m, n, k = check_args(x, w, y)
    auto = choose(m, n, k, splits)
    tiles = tiles or auto.tiles
    variant = auto.variant if variant is None else variant
    kernel = get_kernel(variant, tiles)
    grid = (-(-n // tiles.bn), -(-m // tiles.bm))
    if variant not in SPLIT_K_VARIANTS:
        if splits not in (None, 1):
            raise ValueError(f"gemm_v{variant} has no split-K; splits={splits} needs variant 3 or 4")
        kernel[grid, tiles.threads, stream](x, w, y)
        return
    splits = auto.splits if splits is None else splits
    k_steps = max(1, -(-k // tiles.bk))
    if not 1 <= splits <= k_steps:
        raise ValueError(f"splits={splits} must be between 1 and the {k_steps} k slices of K={k}")
    per = -(-k_steps // splits)
    splits = -(-k_steps // per)  # no empty split
    if splits > 1:
        zero_fill(y, stream)
    kernel[grid + (splits,), tiles.threads, stream](x, w, y, per)


@cuda.jit
def _zero2d(y):
    i, j = cuda.grid(2)
    if i < y.shape[0] and j < y.shape[1]:
        y[i, j] = float32(0.0)


def zero_fill(y, stream=0) -> None:
    """``y[...] = 0`` on ``stream`` (the split-K accumulator)."""
    _zero2d[(-(-y.shape[0] // 16), -(-y.shape[1] // 16)), (16, 16), stream](y)


def validate(
    shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8)),
    tiles: GemmTiles | None = None,
    variants=tuple(VARIANTS),
    rtol: float = 1e-5,
    seed: int = 0,
    splits: int | None = None,
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
            gemm(cuda.to_device(x), cuda.to_device(w), d_y, tiles=tiles, variant=v, splits=splits)
            got = d_y.copy_to_host()
            err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
            records.append({"shape": (m, n, k), "variant": v, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"gemm_v{v} at (M,N,K)={(m, n, k)}: max rel err {err:.3g}")
    return records
