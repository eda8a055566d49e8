"""Backward of causal GQA attention, flash style: the softmax is recomputed tile by tile from
the row statistics ``lse`` (B, nh, T) that the forward saved (``attention(..., lse=)``); no
T x T matrix is ever built.

Inputs q (B, T, nh, hd), k, v (B, T, nkv, hd), o and do (B, T, nh, hd), lse (B, nh, T); outputs
dq (B, T, nh, hd), dk, dv (B, T, nkv, hd). With ``P = exp(q.k / sqrt(hd) - lse)`` (causal) and
``D_i = sum_d do[i, d] o[i, d]``: ``dv_j = sum_i P_ij do_i``, ``dS_ij = P_ij (do_i . v_j - D_i)``,
``dq_i = sum_j dS_ij k_j / sqrt(hd)``, ``dk_j = sum_i dS_ij q_i / sqrt(hd)``.

Recipe: the numpy reference (``reference.attention_backward``), two numbered variants of two
kernels each, a launcher (``attention_backward(..., variant=)``), ``validate()``.

Variant 1 (``BackwardTiles``, the default):

- ``dq`` kernel: one block per (query tile of ``bq`` rows, head, batch), one thread per query
  row holding its q, do and dq (hd floats each, local memory); the block stages ``bkv`` keys
  and values at a time in shared memory (read by every thread at once: broadcasts) up to the
  diagonal.
- ``dkv`` kernel: one block per (key tile of ``bkv`` rows, kv head, batch), one thread per key
  holding its k, v, dk, dv; it walks the query heads of its group and the query tiles from the
  diagonal on, staging q, do, lse and D (computed there from do and o) in shared memory. A key
  head's gradient is the sum over its group, so no atomics are needed.

Each recomputes P: 2 x the forward's exps, and 4 hd multiply-adds per (query, key) pair per
kernel on top. Simple rather than fast: one row per thread keeps 3-4 x hd floats per thread in
local memory (L1). Offline ptxas (sm_90, ``scripts/sass_report.py attention-backward``): 255
registers and 1,272 / 2,344 B of spills per thread (dq / dkv), 2.06 / 2.38 instructions per FMA in
the inner loops, and dkv runs one warp per 32 keys (about 3.9 warps per SM at T = 2048).

Variant 2 (``FlashBackwardTiles``, ``variant=2``): the same two kernels as register-blocked
outer products from shared memory, like the forward's variant 2.

- **dq kernel**: one block per (``rows / heads`` positions, ``heads`` query heads of one GQA
  group, batch): Q (pre-scaled) and dO of its rows stay in shared memory, and its D = rowsum(do o)
  is summed there once. Per key tile (``bkv`` keys of the group's key head, up to the diagonal):
  stage K and V; S = Q K^T and dP = dO V^T as ``tr x tk`` register tiles per thread; P =
  exp(S - lse) and dS = P (dP - D), masked on the diagonal tiles only, stored as dS^T; then
  dQ += dS K as ``to x hd/ncg`` per thread.
- **dkv kernel**: one block per (``keys`` keys, key head, batch): K and V stay in shared memory;
  it walks the query heads of its group and the query tiles of ``bq`` from the diagonal on
  (the tiles above it are skipped, those wholly below skip the mask): stage Q, dO (and D);
  S^T and dP^T as ``tkk x tq`` per thread; P and dS stored; dV += P^T dO and dK += dS^T Q as
  ``tko x hd/ncg`` each. Each key head's gradient is summed over its group by one block: no
  atomics, the result is deterministic.
- **Layouts**: every staged tile is row-major with rows of hd + 4 words (16-byte aligned, a
  quarter warp's 128-bit loads 4 banks apart) when hd % 4 == 0, else hd + 1 (odd: conflict-free
  scalar loads). The score loops read 4 adjacent d of a row per 128-bit load (``dot_tile``:
  ``tr + tk`` loads per ``4 tr tk`` FMAs); the gradient loops read runs of 4 rows of dS / P and
  of 4 columns of K, dO, Q per load. Indices are unsigned (no negative-index wrap-around code);
  staging computes one global address per row and keeps 4 rows' loads in flight.
- **Shared memory** at hd = 128 is the bound: Q, dO, K, V tiles of 16 rows each (about 34 KB)
  leave no room for larger tiles under the 48 KiB of static shared memory, hence 2 x 2 score tiles
  on 64 threads. Offline ptxas (sm_90) of the defaults: dq 108 registers, dkv 137, no spills;
  inner loops at 1.36-1.44 (scores, 8 steps of 4 d unrolled) and 1.18-1.20 (gradients)
  instructions per FMA; whole per-tile loops (staging, exps, barriers included, every cold path
  counted) at 2.5 (dq) and 3.0 (dkv).

Variant 2 is not the default until the H200 has timed it (``experiments/attention_backward_gpu.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, check_ndim, simulating
from .attention import STATIC_SHARED_LIMIT, check_args


@dataclass(frozen=True)
class BackwardTiles:
    """Rows per block of each kernel. Defaults (hd = 128): dq stages 2 x 32 keys x 128 floats
    (32 KiB), dkv 2 x 32 queries (32 KiB + 256 B); 64 / 32 threads per block. Both stay under the
    48 KiB of static shared memory a block may have."""

    bq: int = 64  # query rows per dq block (threads)
    bkv: int = 32  # keys staged per dq step, key rows per dkv block (threads)
    bq_dkv: int = 32  # queries staged per dkv step

    def shared_bytes(self, hd: int) -> int:
        return 4 * max(2 * self.bkv * hd, 2 * self.bq_dkv * hd + 2 * self.bq_dkv)

    def check(self, hd: int) -> None:
        if min(self.bq, self.bkv, self.bq_dkv) <= 0:
            raise KernelError(f"attention backward tiles {self} must be positive")
        if self.shared_bytes(hd) > STATIC_SHARED_LIMIT:
            raise KernelError(f"attention backward tiles {self} with head_dim={hd} need "
                             f"{self.shared_bytes(hd)} bytes of shared memory (> {STATIC_SHARED_LIMIT})")


SIM_TILES = BackwardTiles(bq=4, bkv=4, bq_dkv=4)
NEG_INF = float32(-np.inf)


@lru_cache(maxsize=None)
def make_backward_kernels(hd: int, tiles: BackwardTiles):
    tiles.check(hd)
    HD, BQ, BKV = hd, tiles.bq, tiles.bkv
    BQ_DKV = tiles.bq_dkv  # queries staged per dkv step

    @fastlaunch.jit
    def attention_dq_kernel(q, k, v, o, lse, do, dq, scale):
        t_ = q.shape[1]
        group = q.shape[2] // k.shape[2]
        n_qt = (t_ + BQ - 1) // BQ
        q0 = (n_qt - 1 - cuda.blockIdx.x) * BQ  # longest tiles first
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // group
        tid = cuda.threadIdx.x
        row = q0 + tid
        Ks = cuda.shared.array((BKV, HD), float32)  # (bkv, hd)
        Vs = cuda.shared.array((BKV, HD), float32)
        qr = cuda.local.array(HD, float32)
        dor = cuda.local.array(HD, float32)
        acc = cuda.local.array(HD, float32)
        lse_r = float32(0.0)
        d_r = float32(0.0)
        if row < t_:
            lse_r = lse[b, h, row]
            for d in range(HD):
                qr[d] = q[b, row, h, d] * scale
                x = do[b, row, h, d]
                dor[d] = x
                d_r += x * o[b, row, h, d]
                acc[d] = float32(0.0)
        kv_end = min(t_, q0 + BQ)
        for k0 in range(0, kv_end, BKV):
            for e in range(tid, BKV * HD, BQ):
                r = e // HD
                d = e % HD
                kv = float32(0.0)
                vv = float32(0.0)
                if k0 + r < t_:
                    kv = k[b, k0 + r, hk, d]
                    vv = v[b, k0 + r, hk, d]
                Ks[r, d] = kv
                Vs[r, d] = vv
            cuda.syncthreads()
            if row < t_:
                for j in range(BKV):
                    key = k0 + j
                    if key <= row:
                        s = float32(0.0)
                        dp = float32(0.0)
                        for d in range(HD):
                            s += qr[d] * Ks[j, d]
                            dp += dor[d] * Vs[j, d]
                        ds = math.exp(s - lse_r) * (dp - d_r)
                        for d in range(HD):
                            acc[d] += ds * Ks[j, d]
            cuda.syncthreads()
        if row < t_:
            for d in range(HD):
                dq[b, row, h, d] = acc[d] * scale

    @fastlaunch.jit
    def attention_dkv_kernel(q, k, v, o, lse, do, dk, dv, scale):
        t_ = q.shape[1]
        group = q.shape[2] // k.shape[2]
        k0 = cuda.blockIdx.x * BKV  # earliest keys see the most queries: they start first
        hk = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        key = k0 + tid
        Qs = cuda.shared.array((BQ_DKV, HD), float32)  # (bq, hd) scaled queries
        Ds = cuda.shared.array((BQ_DKV, HD), float32)  # (bq, hd) output gradients
        Ls = cuda.shared.array(BQ_DKV, float32)  # lse of the staged rows
        Dd = cuda.shared.array(BQ_DKV, float32)  # D = rowsum(do * o) of the staged rows
        kr = cuda.local.array(HD, float32)
        vr = cuda.local.array(HD, float32)
        dka = cuda.local.array(HD, float32)
        dva = cuda.local.array(HD, float32)
        if key < t_:
            for d in range(HD):
                kr[d] = k[b, key, hk, d]
                vr[d] = v[b, key, hk, d]
                dka[d] = float32(0.0)
                dva[d] = float32(0.0)
        for g in range(group):
            h = hk * group + g
            for q0 in range(k0 - k0 % BQ_DKV, t_, BQ_DKV):
                for e in range(tid, BQ_DKV * HD, BKV):
                    r = e // HD
                    d = e % HD
                    qv = float32(0.0)
                    dov = float32(0.0)
                    if q0 + r < t_:
                        qv = q[b, q0 + r, h, d] * scale
                        dov = do[b, q0 + r, h, d]
                    Qs[r, d] = qv
                    Ds[r, d] = dov
                for r in range(tid, BQ_DKV, BKV):
                    lv = float32(0.0)
                    dd = float32(0.0)
                    if q0 + r < t_:
                        lv = lse[b, h, q0 + r]
                        for d in range(HD):
                            dd += do[b, q0 + r, h, d] * o[b, q0 + r, h, d]
                    Ls[r] = lv
                    Dd[r] = dd
                cuda.syncthreads()
                if key < t_:
                    for i in range(BQ_DKV):
                        row = q0 + i
                        if row >= key and row < t_:
                            s = float32(0.0)
                            dp = float32(0.0)
                            for d in range(HD):
                                s += Qs[i, d] * kr[d]
                                dp += Ds[i, d] * vr[d]
                            p = math.exp(s - Ls[i])
                            ds = p * (dp - Dd[i])
                            for d in range(HD):
                                dva[d] += p * Ds[i, d]
                                dka[d] += ds * Qs[i, d]  # Qs is pre-scaled: dk = dS^T q scale
                cuda.syncthreads()
        if key < t_:
            for d in range(HD):
                dk[b, key, hk, d] = dka[d]
                dv[b, key, hk, d] = dva[d]

    return attention_dq_kernel, attention_dkv_kernel


# ---- variant 2 ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlashBackwardTiles:
    """Tile shape of variant 2 (see the module docstring).

    dq kernel: ``rows`` query rows per block (``rows / heads`` positions of ``heads`` query heads
    of one GQA group), key tiles of ``bkv``; S and dP as ``tr x tk`` tiles per thread, dQ as
    ``to x hd/ncg`` per thread. dkv kernel: ``keys`` keys per block, query tiles of ``bq``; S^T
    and dP^T as ``tkk x tq`` per thread, dK and dV as ``tko x hd/ncg`` each.

    Defaults (hd = 128): both kernels 64 threads; shared memory (words, rows of hd + 4)
    2 (rows + bkv)(hd + 4) + bkv (rows + 4) + rows (1 + parts) = 35.4 KB for dq and
    2 (keys + bq)(hd + 4) + 2 bq (keys + 4) + bq (1 + parts) = 36.7 KB for dkv: tiles of 32 rows
    would not fit the 48 KiB, so the tiles stay at 16 x 16 and the outer products are 2 x 2
    (scores) and 4 x 8 (gradients: 2 x 32 accumulators per thread in dkv). Offline ptxas also
    compiles 32-thread shapes without spills (``16/4/16/4/2/4/16/16/2/4/4``: 4 x 2 scores, 174 /
    245 registers, 1.12-1.15 instructions per FMA in the inner loops); untimed."""

    rows: int = 16  # query rows per dq block (positions x heads)
    heads: int = 4  # at most this many query heads of one group per dq block
    bkv: int = 16  # keys per dq step
    tr: int = 2  # dq: score rows per thread
    tk: int = 2  # dq: score keys per thread
    to: int = 4  # dq: dQ rows per thread
    keys: int = 16  # keys per dkv block
    bq: int = 16  # queries per dkv step
    tkk: int = 2  # dkv: score keys per thread
    tq: int = 2  # dkv: score queries per thread
    tko: int = 4  # dkv: dK / dV rows (keys) per thread

    @classmethod
    def parse(cls, text: str) -> "FlashBackwardTiles":
        """``rows/heads/bkv/tr/tk/to/keys/bq/tkk/tq/tko`` (every field, in order) -> tiles."""
        parts = text.strip().split("/")
        if len(parts) != len(fields(cls)) or not all(p.isdigit() for p in parts):
            raise KernelError(f"attention backward tiles {text!r} are not rows/heads/bkv/tr/tk/to/keys/bq/tkk/tq/tko")
        return cls(*map(int, parts))

    @property
    def dq_threads(self) -> int:
        return (self.rows // self.tr) * (self.bkv // self.tk)

    @property
    def dkv_threads(self) -> int:
        return (self.keys // self.tkk) * (self.bq // self.tq)

    def heads_for(self, group: int) -> int:
        """Largest divisor of ``group`` that is at most ``heads`` and divides ``rows``."""
        for g in range(min(self.heads, group), 0, -1):
            if group % g == 0 and self.rows % g == 0:
                return g
        return 1

    def _parts(self, rows: int, threads: int) -> int:
        return max(1, threads // rows)  # threads per row of the D = rowsum(do * o) products

    def shared_bytes(self, hd: int) -> int:
        hdp = hd + 4 if hd % 4 == 0 else hd + 1  # padded row lengths, as make_flash_backward_kernels
        rp = self.rows + 4 if self.to % 4 == 0 else self.rows + 1
        kp = self.keys + 4 if self.tko % 4 == 0 else self.keys + 1
        dq = (2 * (self.rows + self.bkv) * hdp + self.bkv * rp + self.rows
              + self.rows * self._parts(self.rows, self.dq_threads))
        dkv = (2 * (self.keys + self.bq) * hdp + 2 * self.bq * kp + self.bq
               + self.bq * self._parts(self.bq, self.dkv_threads))
        return 4 * max(dq, dkv)

    def check(self, hd: int) -> None:
        bad = []
        if min(self.rows, self.heads, self.bkv, self.tr, self.tk, self.to, self.keys, self.bq,
               self.tkk, self.tq, self.tko) <= 0:
            bad.append("every field must be positive")
        elif (self.rows % self.tr or self.bkv % self.tk or self.rows % self.to or self.keys % self.tkk
              or self.bq % self.tq or self.keys % self.tko):
            bad.append("rows % tr, bkv % tk, rows % to, keys % tkk, bq % tq and keys % tko must be 0")
        elif self.dq_threads % (self.rows // self.to) or self.dkv_threads % (self.keys // self.tko):
            bad.append("the threads must split into whole column groups of the gradient phases")
        elif max(self.dq_threads, self.dkv_threads) > 1024:
            bad.append(f"needs {max(self.dq_threads, self.dkv_threads)} threads (> 1024)")
        if self.shared_bytes(hd) > STATIC_SHARED_LIMIT:
            bad.append(f"needs {self.shared_bytes(hd)} bytes of shared memory (> {STATIC_SHARED_LIMIT})")
        if bad:
            raise KernelError(f"attention backward tiles {self} with head_dim={hd}: " + "; ".join(bad))


# Candidates beside the default (experiments/attention_backward_gpu.py times them; untimed yet):
# 32 threads, 4 x 2 score tiles in dq and 2 x 4 in dkv (ptxas sm_90: 174 / 245 registers, no spill).
FLASH_BACKWARD_CANDIDATES = (
    FlashBackwardTiles(tr=4, tk=2, tq=4),
)

# Simulator: 4 threads per kernel, 4 x 4 tiles (2 positions x 2 heads in dq).
SIM_FLASH_TILES = FlashBackwardTiles(rows=4, heads=2, bkv=4, tr=2, tk=2, to=2, keys=4, bq=4, tkk=2, tq=2, tko=2)


@lru_cache(maxsize=None)
def make_flash_backward_kernels(hd: int, tiles: FlashBackwardTiles, heads: int):
    """Variant 2's dq and dkv kernels for head_dim ``hd`` and ``heads`` query heads per dq block.
    Arguments of both: q, k, v, o, lse, do, then dq (dq kernel) or dk, dv (dkv kernel), scale."""
    tiles.check(hd)
    if tiles.rows % heads:
        raise KernelError(f"{heads} heads per block do not divide the {tiles.rows} rows of {tiles}")
    HD = hd
    # Shared rows of hd + 4 words (hd % 4 == 0: 16-byte aligned rows, and the 8 rows of a quarter
    # warp's 128-bit loads start 4 banks apart) or hd + 1 (odd: a column read by many rows is
    # conflict-free); the d loops then go by 4 (128-bit loads) or by 1.
    UD = 4 if hd % 4 == 0 else 1
    HDP = hd + 4 if UD == 4 else hd + 1
    ALIGN = None if simulating() else 16
    # loop unrolling (trip counts are constants): 8 steps of the d loops (32 d with 128-bit
    # loads; 4 steps took 1.45 instructions per FMA, 8 take 1.36-1.44), 4 keys / queries of the
    # gradient loops, when they divide
    NU = 8 if hd % (8 * UD) == 0 else 4 if hd % (4 * UD) == 0 else 1
    R, BKV, TR, TK, TO = tiles.rows, tiles.bkv, tiles.tr, tiles.tk, tiles.to
    HEADS = heads
    BQ = R // HEADS  # positions per dq block
    NT = tiles.dq_threads
    NKG = BKV // TK  # key groups of dq's score phase
    NRG = R // TR  # row groups of dq's score phase
    NOG = R // TO  # row groups of dq's gradient phase
    NCG = NT // NOG  # column groups of dq's gradient phase
    TD = -(-HD // NCG)  # dQ columns per thread
    PARTS = tiles._parts(R, NT)
    # Gradient phases: a thread's rows (keys) and columns come in runs of 4 adjacent ones when it
    # has a multiple of 4 (one 128-bit shared load per run: dS / P rows padded to a multiple of
    # 4 words, 16-byte aligned), else one by one (rows padded to an odd length: conflict-free).
    VO = 4 if TO % 4 == 0 else 1
    VC = 4 if TD % 4 == 0 and UD == 4 else 1
    RP = R + 4 if VO == 4 else R + 1  # row length of dS^T in dq
    KEYS, QB, TKK, TQ, TKO = tiles.keys, tiles.bq, tiles.tkk, tiles.tq, tiles.tko
    NT2 = tiles.dkv_threads
    NQG2 = QB // TQ  # query groups of dkv's score phase
    NKG2 = KEYS // TKK  # key groups of dkv's score phase
    NOG2 = KEYS // TKO  # key groups of dkv's gradient phase
    NCG2 = NT2 // NOG2  # column groups of dkv's gradient phase
    TD2 = -(-HD // NCG2)
    PARTS2 = tiles._parts(QB, NT2)
    VO2 = 4 if TKO % 4 == 0 else 1
    VC2 = 4 if TD2 % 4 == 0 and UD == 4 else 1
    KP = KEYS + 4 if VO2 == 4 else KEYS + 1  # row length of P and dS in dkv
    # shared array sizes (words) as constants: Numba needs literal shapes
    W_R, W_BKV, W_DS, W_DP = R * HDP, BKV * HDP, BKV * RP, R * PARTS
    W_KEYS, W_QB, W_P, W_DP2 = KEYS * HDP, QB * HDP, QB * KP, QB * PARTS2
    BUF = 4 * max(1, HD // min(NT, NT2))  # staging registers: 4 rows of hd / threads words
    UJ = 4 if BKV % 4 == 0 else 1
    UQ = 4 if QB % 4 == 0 else 1
    EXACT, EXACT2 = TD * NCG == HD, TD2 * NCG2 == HD  # no column past hd in the gradient phases

    U = uint64

    @cuda.jit(device=True, inline="always")
    def dot_step(acc, A, B, ao, sa, bo, sb, d, a_reg, b_reg):
        """acc[i, j] += sum over d .. d + UD - 1 of A[ao + i sa + d] B[bo + j sb + d]: each row's
        UD adjacent words are one 128-bit shared load (hd % 4 == 0: rows of hd + 4 words)."""
        ni = a_reg.shape[0]
        nj = b_reg.shape[0]
        for i in range(ni):
            for u in range(UD):
                a_reg[i, u] = A[ao + U(i * sa) + d + U(u)]
        for j in range(nj):
            for u in range(UD):
                b_reg[j, u] = B[bo + U(j * sb) + d + U(u)]
        for u in range(UD):
            for i in range(ni):
                for j in range(nj):
                    acc[i, j] += a_reg[i, u] * b_reg[j, u]

    @cuda.jit(device=True, inline="always")
    def dot_tile(acc, A, B, ao, sa, bo, sb, a_reg, b_reg):
        """acc[i, j] = sum_d A[ao + i sa + d] B[bo + j sb + d] (flat row-major tiles of HDP
        words per row), as outer products of the register fragments a_reg (ni x UD) and b_reg
        (nj x UD): ni + nj shared loads (128-bit when UD = 4) per ni nj UD FMAs."""
        ni = a_reg.shape[0]
        nj = b_reg.shape[0]
        for i in range(ni):
            for j in range(nj):
                acc[i, j] = float32(0.0)
        for d0 in range(0, HD, UD * NU):  # unrolled by hand: Numba's range loops stay loops
            d = U(d0)
            dot_step(acc, A, B, ao, sa, bo, sb, d, a_reg, b_reg)
            if NU >= 4:
                dot_step(acc, A, B, ao, sa, bo, sb, d + U(UD), a_reg, b_reg)
                dot_step(acc, A, B, ao, sa, bo, sb, d + U(2 * UD), a_reg, b_reg)
                dot_step(acc, A, B, ao, sa, bo, sb, d + U(3 * UD), a_reg, b_reg)
            if NU == 8:
                for u in (4, 5, 6, 7):
                    dot_step(acc, A, B, ao, sa, bo, sb, d + U(u * UD), a_reg, b_reg)

    @cuda.jit(device=True, inline="always")
    def outer_step(acc, A, ao, va, sa, B, bo, vb, sb, col0, a_reg, b_reg, exact):
        """acc[i, c] += A[ao + run(i)] B[bo + run(c)], run(i) = (i // va) sa + i % va: runs of
        va (vb) adjacent words, one 128-bit shared load each when 4; B's column col0 + run(c)
        past hd reads 0 unless ``exact``."""
        ni = a_reg.shape[0]
        nc = b_reg.shape[0]
        for i in range(ni):
            a_reg[i] = A[ao + U((i // va) * sa + i % va)]
        for c in range(nc):
            off = U((c // vb) * sb + c % vb)
            val = float32(0.0)
            if exact or col0 + off < U(HD):
                val = B[bo + off]
            b_reg[c] = val
        for i in range(ni):
            for c in range(nc):
                acc[i, c] += a_reg[i] * b_reg[c]

    @cuda.jit(device=True, inline="always")
    def dq_step(acc, dSs, Ks, j, og, cg, p_reg, k_reg):
        """dq's gradient phase for key j: dQ[rows, cols] += dS^T[j, rows] (x) K[j, cols]."""
        outer_step(acc, dSs, j * U(RP) + og * U(VO), VO, NOG * VO, Ks, j * U(HDP) + cg * U(VC), VC, NCG * VC,
                   cg * U(VC), p_reg, k_reg, EXACT)

    @cuda.jit(device=True, inline="always")
    def grad_step(dva, dka, Ps, dSs, DOs, Qs, r, og, cg, a_reg, x_reg):
        """dkv's gradient phase for query r: dV += P[r, keys] (x) dO[r, cols], dK += dS (x) Q."""
        ao, bo = r * U(KP) + og * U(VO2), r * U(HDP) + cg * U(VC2)
        outer_step(dva, Ps, ao, VO2, NOG2 * VO2, DOs, bo, VC2, NCG2 * VC2, cg * U(VC2), a_reg, x_reg, EXACT2)
        outer_step(dka, dSs, ao, VO2, NOG2 * VO2, Qs, bo, VC2, NCG2 * VC2, cg * U(VC2), a_reg, x_reg, EXACT2)

    @cuda.jit(device=True, inline="always")
    def stage_one(dst, src, b, pos0, n_pos, h0, T, mul, e, buf, u):
        """buf[u] <- element e of the tile (row e // hd: position pos0 + row % n_pos of head
        h0 + row // n_pos; zero past T)."""
        r = e // U(HD)
        pos = pos0 + r % U(n_pos)
        val = float32(0.0)
        if pos < T:
            val = src[b, pos, h0 + r // U(n_pos), e % U(HD)] * mul
        buf[u] = val

    @cuda.jit(device=True, inline="always")
    def stage_rows(dst, src, b, pos0, n_pos, h0, n_rows, T, mul, tid, nt, buf):
        """dst[r HDP + d] <- src[b, pos0 + r % n_pos, h0 + r // n_pos, d] * mul for r < n_rows;
        zero past T. Consecutive threads take consecutive d: coalesced loads, conflict-free
        stores. When the threads divide hd, thread t takes d = t, t + nt, ... of every row: one
        address computation per row, not per element, and 4 rows' loads in flight (``buf``)
        before their stores (the first version, one signed element per iteration, spent ~90
        instructions per element and waited on each load)."""
        if HD % nt == 0:
            per = HD // nt
            ru = 4 if n_rows % 4 == 0 else 1
            tu = U(tid)
            for r0 in range(0, n_rows, ru):
                for u in range(ru):
                    r = U(r0 + u)
                    pos = pos0 + r % U(n_pos)
                    h = h0 + r // U(n_pos)
                    for x in range(per):
                        val = float32(0.0)
                        if pos < T:
                            val = src[b, pos, h, tu + U(x * nt)] * mul
                        buf[u * per + x] = val
                for u in range(ru):
                    for x in range(per):
                        dst[U(r0 + u) * U(HDP) + tu + U(x * nt)] = buf[u * per + x]
        else:
            n = U(n_rows * HD)
            step = U(nt)
            for e0 in range(tid, n_rows * HD, 4 * nt):
                e = U(e0)
                for u in range(4):
                    if e + U(u) * step < n:
                        stage_one(dst, src, b, pos0, n_pos, h0, T, mul, e + U(u) * step, buf, u)
                for u in range(4):
                    x = e + U(u) * step
                    if x < n:
                        dst[(x // U(HD)) * U(HDP) + x % U(HD)] = buf[u]

    @cuda.jit(device=True, inline="always")
    def row_dots(Dp, DOs, o, b, pos0, n_pos, h0, n_rows, T, parts, tid, nt):
        """Dp[r parts + p] <- partial sums of D = rowsum(do * o) of row r (do staged in DOs):
        thread (r, p) takes d = p, p + parts, ... (the reader sums the parts)."""
        for e0 in range(tid, n_rows * parts, nt):
            e = U(e0)
            r = e // U(parts)
            p = e % U(parts)
            pos = pos0 + r % U(n_pos)
            acc = float32(0.0)
            if pos < T:
                h = h0 + r // U(n_pos)
                if HD % parts == 0:  # constant trip count: unrolled, offsets are immediates
                    for x in range(HD // parts):
                        d = p + U(x * parts)
                        acc += DOs[r * U(HDP) + d] * o[b, pos, h, d]
                else:
                    for d in range(p, U(HD), U(parts)):
                        acc += DOs[r * U(HDP) + d] * o[b, pos, h, d]
            Dp[e] = acc

    @fastlaunch.jit
    def flash_dq_kernel(q, k, v, o, lse, do, dq, scale):
        # unsigned block scalars and indices: no negative-index wrap-around code
        T = U(q.shape[1])
        group = U(q.shape[2] // k.shape[2])
        sub = group // U(HEADS)
        n_qt = (T + U(BQ - 1)) // U(BQ)
        q0 = (n_qt - U(1) - U(cuda.blockIdx.x)) * U(BQ)  # longest tiles first
        hk = U(cuda.blockIdx.y) // sub
        h0 = hk * group + (U(cuda.blockIdx.y) % sub) * U(HEADS)
        b = U(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        Qs = cuda.shared.array(W_R, float32, alignment=ALIGN)  # (rows, HDP) scaled queries
        DOs = cuda.shared.array(W_R, float32, alignment=ALIGN)  # (rows, HDP) output gradients
        Ks = cuda.shared.array(W_BKV, float32, alignment=ALIGN)  # (bkv, HDP)
        Vs = cuda.shared.array(W_BKV, float32, alignment=ALIGN)
        dSs = cuda.shared.array(W_DS, float32, alignment=ALIGN)  # (bkv, RP) dS^T of this tile
        Ls = cuda.shared.array(R, float32)  # lse of the rows
        Dp = cuda.shared.array(W_DP, float32, alignment=ALIGN)  # partial sums of D
        s = cuda.local.array((TR, TK), float32)
        dp = cuda.local.array((TR, TK), float32)
        acc = cuda.local.array((TO, TD), float32)
        k_reg = cuda.local.array(TD, float32)
        p_reg = cuda.local.array(TO, float32)
        a_reg = cuda.local.array((TR, UD), float32)
        b_reg = cuda.local.array((TK, UD), float32)
        buf = cuda.local.array(BUF, float32)  # staging loads in flight
        rg = tid // NKG  # score phase: rows rg + i NRG, keys kg + j NKG
        kg = tid % NKG
        og = U(tid // NCG)  # gradient phase: row group og and column group cg (runs of VO, VC)
        cg = U(tid % NCG)
        qo, ko = U(rg * HDP), U(kg * HDP)

        stage_rows(Qs, q, b, q0, BQ, h0, R, T, scale, tid, NT, buf)
        stage_rows(DOs, do, b, q0, BQ, h0, R, T, float32(1.0), tid, NT, buf)
        for r in range(tid, R, NT):
            ru = U(r)
            pos = q0 + ru % U(BQ)
            Ls[r] = lse[b, h0 + ru // U(BQ), pos] if pos < T else float32(0.0)
        cuda.syncthreads()
        row_dots(Dp, DOs, o, b, q0, BQ, h0, R, T, PARTS, tid, NT)
        for i in range(TO):
            for c in range(TD):
                acc[i, c] = float32(0.0)
        kv_end = min(T, q0 + U(BQ))
        for kt in range((kv_end + U(BKV - 1)) // U(BKV)):
            k0 = kt * U(BKV)
            stage_rows(Ks, k, b, k0, BKV, hk, BKV, T, float32(1.0), tid, NT, buf)
            stage_rows(Vs, v, b, k0, BKV, hk, BKV, T, float32(1.0), tid, NT, buf)
            cuda.syncthreads()
            dot_tile(s, Qs, Ks, qo, NRG * HDP, ko, NKG * HDP, a_reg, b_reg)
            dot_tile(dp, DOs, Vs, qo, NRG * HDP, ko, NKG * HDP, a_reg, b_reg)
            masked = k0 + U(BKV) > q0 + U(1)  # the diagonal (and ragged) tiles; the others skip the test
            for i in range(TR):
                r = rg + i * NRG
                pos = q0 + U(r % BQ)
                l_r = Ls[r]
                d_r = float32(0.0)
                for p in range(PARTS):
                    d_r += Dp[r * PARTS + p]
                for j in range(TK):
                    key = kg + j * NKG
                    ds = math.exp(s[i, j] - l_r) * (dp[i, j] - d_r)
                    if masked and k0 + U(key) > pos:
                        ds = float32(0.0)
                    dSs[key * RP + r] = ds
            cuda.syncthreads()
            for j0 in range(0, BKV, UJ):  # dQ += dS K, unrolled by hand
                j = U(j0)
                dq_step(acc, dSs, Ks, j, og, cg, p_reg, k_reg)
                if UJ == 4:
                    for u in (1, 2, 3):
                        dq_step(acc, dSs, Ks, j + U(u), og, cg, p_reg, k_reg)
            cuda.syncthreads()
        for i in range(TO):
            r = og * U(VO) + U((i // VO) * NOG * VO + i % VO)
            pos = q0 + r % U(BQ)
            if pos < T:
                h = h0 + r // U(BQ)
                for c in range(TD):
                    col = cg * U(VC) + U((c // VC) * NCG * VC + c % VC)
                    if EXACT or col < U(HD):
                        dq[b, pos, h, col] = acc[i, c] * scale

    @fastlaunch.jit
    def flash_dkv_kernel(q, k, v, o, lse, do, dk, dv, scale):
        T = U(q.shape[1])
        group = U(q.shape[2] // k.shape[2])
        k0 = U(cuda.blockIdx.x) * U(KEYS)  # earliest keys see the most queries: they start first
        hk = U(cuda.blockIdx.y)
        b = U(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        Ks = cuda.shared.array(W_KEYS, float32, alignment=ALIGN)  # (keys, HDP)
        Vs = cuda.shared.array(W_KEYS, float32, alignment=ALIGN)
        Qs = cuda.shared.array(W_QB, float32, alignment=ALIGN)  # (bq, HDP) scaled queries of this step
        DOs = cuda.shared.array(W_QB, float32, alignment=ALIGN)  # (bq, HDP) their output gradients
        Ps = cuda.shared.array(W_P, float32, alignment=ALIGN)  # (bq, KP) probabilities
        dSs = cuda.shared.array(W_P, float32, alignment=ALIGN)  # (bq, KP) dS
        Ls = cuda.shared.array(QB, float32)
        Dp = cuda.shared.array(W_DP2, float32, alignment=ALIGN)
        s = cuda.local.array((TKK, TQ), float32)  # S^T
        dp = cuda.local.array((TKK, TQ), float32)  # dP^T
        dka = cuda.local.array((TKO, TD2), float32)
        dva = cuda.local.array((TKO, TD2), float32)
        a_reg = cuda.local.array(TKO, float32)
        x_reg = cuda.local.array(TD2, float32)
        k_frag = cuda.local.array((TKK, UD), float32)
        q_frag = cuda.local.array((TQ, UD), float32)
        buf = cuda.local.array(BUF, float32)
        qg = tid // NKG2  # score phase: keys kg + j NKG2, queries qg + i NQG2
        kg = tid % NKG2
        og = U(tid // NCG2)  # gradient phase: key group og and column group cg (runs of VO2, VC2)
        cg = U(tid % NCG2)
        ko, qo = U(kg * HDP), U(qg * HDP)

        stage_rows(Ks, k, b, k0, KEYS, hk, KEYS, T, float32(1.0), tid, NT2, buf)
        stage_rows(Vs, v, b, k0, KEYS, hk, KEYS, T, float32(1.0), tid, NT2, buf)
        for j in range(TKO):
            for c in range(TD2):
                dka[j, c] = float32(0.0)
                dva[j, c] = float32(0.0)
        for g in range(group):
            h = hk * group + g
            q_first = k0 - k0 % U(QB)
            for qt in range((T - q_first + U(QB - 1)) // U(QB)):
                q0 = q_first + qt * U(QB)
                stage_rows(Qs, q, b, q0, QB, h, QB, T, scale, tid, NT2, buf)
                stage_rows(DOs, do, b, q0, QB, h, QB, T, float32(1.0), tid, NT2, buf)
                for r in range(tid, QB, NT2):
                    Ls[r] = lse[b, h, q0 + U(r)] if q0 + U(r) < T else float32(0.0)
                cuda.syncthreads()
                row_dots(Dp, DOs, o, b, q0, QB, h, QB, T, PARTS2, tid, NT2)
                dot_tile(s, Ks, Qs, ko, NKG2 * HDP, qo, NQG2 * HDP, k_frag, q_frag)
                dot_tile(dp, Vs, DOs, ko, NKG2 * HDP, qo, NQG2 * HDP, k_frag, q_frag)
                cuda.syncthreads()  # Dp written
                # rows below the diagonal and inside T skip the mask (zeroed rows past T would
                # add nothing anyway: q = do = 0, lse = D = 0 give p = 1 and dS = 0 x p)
                masked = q0 + U(1) < k0 + U(KEYS) or q0 + U(QB) > T
                for i in range(TQ):
                    r = qg + i * NQG2
                    l_r = Ls[r]
                    d_r = float32(0.0)
                    for p in range(PARTS2):
                        d_r += Dp[r * PARTS2 + p]
                    for j in range(TKK):
                        key = kg + j * NKG2
                        p_ = math.exp(s[j, i] - l_r)
                        if masked and (q0 + U(r) < k0 + U(key) or q0 + U(r) >= T):
                            p_ = float32(0.0)
                        Ps[r * KP + key] = p_
                        dSs[r * KP + key] = p_ * (dp[j, i] - d_r)
                cuda.syncthreads()
                for r0 in range(0, QB, UQ):  # dV += P^T dO, dK += dS^T Q (Q pre-scaled), unrolled
                    ru = U(r0)
                    grad_step(dva, dka, Ps, dSs, DOs, Qs, ru, og, cg, a_reg, x_reg)
                    if UQ == 4:
                        for u in (1, 2, 3):
                            grad_step(dva, dka, Ps, dSs, DOs, Qs, ru + U(u), og, cg, a_reg, x_reg)
                cuda.syncthreads()
        for j in range(TKO):
            key = k0 + og * U(VO2) + U((j // VO2) * NOG2 * VO2 + j % VO2)
            if key < T:
                for c in range(TD2):
                    col = cg * U(VC2) + U((c // VC2) * NCG2 * VC2 + c % VC2)
                    if EXACT2 or col < U(HD):
                        dk[b, key, hk, col] = dka[j, c]
                        dv[b, key, hk, col] = dva[j, c]

    return flash_dq_kernel, flash_dkv_kernel


# Variant 2 since the H200 timed it (experiments/results/kernels-h200/run5-attn-bwd/): 8-12x faster
# than variant 1 at T = 1024-4096 (32 heads of 128, 8 kv heads), the same error against SDPA's
# gradients. Variant 1 stays for head dims whose variant-2 tiles exceed static shared memory.
DEFAULT_VARIANT = 2


def default_variant(hd: int, tiles=None) -> int:
    """The variant ``attention_backward`` runs when none is given: the one ``tiles`` belong to,
    else :data:`DEFAULT_VARIANT` where its default tiles fit ``hd``, else variant 1."""
    if isinstance(tiles, FlashBackwardTiles):
        return 2
    if isinstance(tiles, BackwardTiles):
        return 1
    if DEFAULT_VARIANT == 2:
        flash = SIM_FLASH_TILES if simulating() else FlashBackwardTiles()
        return 2 if flash.shared_bytes(hd) <= STATIC_SHARED_LIMIT else 1
    return DEFAULT_VARIANT


def attention_backward(q, k, v, o, lse, do, dq, dk, dv, stream=0,
                       tiles: BackwardTiles | FlashBackwardTiles | None = None, variant: int | None = None):
    """Enqueue the gradients dq, dk, dv of causal attention (shapes in the module docstring).
    ``variant`` 1 or 2 (register-blocked; default :func:`default_variant`: the class of
    ``tiles``, else 2 where its tiles fit ``hd``)."""
    b, t, nh, nkv, hd = check_args(q, k, v, o)
    for name, a, like in (("do", do, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, k)):
        check_float32(name, a)
        if tuple(a.shape) != tuple(like.shape):
            raise KernelError(f"attention backward: {name} has shape {tuple(a.shape)}, expected {tuple(like.shape)}")
    check_float32("lse", lse)
    check_ndim("lse", lse, 3)
    if tuple(lse.shape) != (b, nh, t):
        raise KernelError(f"attention backward: lse has shape {tuple(lse.shape)}, expected (B, nh, T) = {(b, nh, t)}")
    if variant is None:
        variant = default_variant(hd, tiles)
    if variant not in (1, 2):
        raise KernelError(f"attention backward: variant={variant} is not 1 or 2")
    want = BackwardTiles if variant == 1 else FlashBackwardTiles
    if tiles is not None and not isinstance(tiles, want):
        raise KernelError(f"attention backward: variant {variant} takes {want.__name__}, got {type(tiles).__name__}")
    if b * t * nh == 0:
        return
    scale = np.float32(1.0 / math.sqrt(hd))
    if variant == 2:
        tiles = tiles or (SIM_FLASH_TILES if simulating() else FlashBackwardTiles())
        heads = tiles.heads_for(nh // nkv)
        k_dq, k_dkv = make_flash_backward_kernels(hd, tiles, heads)
        bq = tiles.rows // heads
        k_dq[(-(-t // bq), nh // heads, b), tiles.dq_threads, stream](q, k, v, o, lse, do, dq, scale)
        k_dkv[(-(-t // tiles.keys), nkv, b), tiles.dkv_threads, stream](q, k, v, o, lse, do, dk, dv, scale)
        return
    tiles = tiles or (SIM_TILES if simulating() else BackwardTiles())
    k_dq, k_dkv = make_backward_kernels(hd, tiles)
    k_dq[(-(-t // tiles.bq), nh, b), tiles.bq, stream](q, k, v, o, lse, do, dq, scale)
    k_dkv[(-(-t // tiles.bkv), nkv, b), tiles.bkv, stream](q, k, v, o, lse, do, dk, dv, scale)


def validate(shapes=((1, 5, 2, 2, 4), (2, 9, 4, 2, 8), (1, 7, 3, 1, 6)),
             tiles: BackwardTiles | FlashBackwardTiles | None = None, rtol: float = 1e-5, seed: int = 0,
             variant: int | None = None) -> list[dict]:
    """Each shape is (B, T, nh, nkv, hd); the forward kernel's lse feeds the backward."""
    from .attention import attention

    rng = np.random.default_rng(seed)
    records = []
    for b, t, nh, nkv, hd in shapes:
        q = rng.standard_normal((b, t, nh, hd), dtype=np.float32)  # (B, T, nh, hd)
        k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)  # (B, T, nkv, hd)
        v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)
        do = rng.standard_normal((b, t, nh, hd), dtype=np.float32)
        o, lse = reference.attention_lse(q, k, v)
        want = reference.attention_backward(q, k, v, o, lse, do)
        d_q, d_k, d_v, d_do = (cuda.to_device(a) for a in (q, k, v, do))
        d_o = cuda.device_array(q.shape, dtype=np.float32)
        d_lse = cuda.device_array((b, nh, t), dtype=np.float32)
        attention(d_q, d_k, d_v, d_o, lse=d_lse)
        outs = [cuda.device_array(a.shape, dtype=np.float32) for a in (q, k, v)]
        attention_backward(d_q, d_k, d_v, d_o, d_lse, d_do, *outs, tiles=tiles, variant=variant)
        for name, got, w in (("o", d_o, o), ("lse", d_lse, lse), *zip(("dq", "dk", "dv"), outs, want)):
            err = float(np.max(np.abs(got.copy_to_host() - w)) / np.max(np.abs(w)))
            records.append({"shape": (b, t, nh, nkv, hd), "out": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"attention backward {name} at (B,T,nh,nkv,hd)={(b, t, nh, nkv, hd)}: "
                                     f"max rel err {err:.3g}")
    return records
