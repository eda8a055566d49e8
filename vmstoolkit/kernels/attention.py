"""Causal attention, tiled with an online softmax (never builds the T x T score matrix).

q (B, T, nh, hd), k and v (B, T, nkv, hd), o (B, T, nh, hd), float32, scale 1/sqrt(hd); query
head h reads key/value head ``h // (nh // nkv)`` (grouped-query attention). With ``lse`` (B, nh, T)
the kernels also write each row's log-sum-exp of the scaled scores, the statistics that
:mod:`attention_backward` recomputes the softmax from.

Recipe: the numpy reference (``reference.attention``), two numbered kernels, a launch rule
(:func:`choose`), one launcher (:func:`attention`) and ``validate()``.

Variant 1 (``make_attention_kernel``, the first kernel, kept for comparison): one block per
(query tile of ``bq`` rows, head, batch). The query tile is staged once in shared memory
(pre-scaled, d-major); the block then walks the key/value tiles of ``bkv`` keys up to the
diagonal (later tiles are all masked and skipped):

1. stage K (d-major) and V (key-major) of the tile in shared memory;
2. scores: thread (rg, lane) computes rows ``rg + i * bq/rm`` x keys ``lane + j * tpr`` (an
   ``rm x bkv/tpr`` register tile), masks (key > query or key >= T) to -inf, writes them to a
   ``bq x bkv`` shared tile;
3. online softmax and P @ V: each thread reads the full score row of each of its rows, gets the
   new running max ``m``, rescales its accumulators by ``exp(m_old - m)``, and adds
   ``exp(s - m) * V`` to the ``rm x hd/tpr`` output columns ``lane + c * tpr`` it owns, keeping
   the running sum ``l``. The ``tpr`` threads of a row recompute the same exps.

At the end ``o = acc / l``. Shared memory (float32 words): hd*(bq+1) + hd*(bkv+1) + bkv*hd +
bq*(bkv+1), within the 48 KiB of static shared memory. On the H200 it ran at 0.14x SDPA's speed
(T 1024) to 0.53x (T 4096, GQA): every score costs one shared load per FMA, and every exp is
computed ``tpr`` = 8 times.

Variant 2 (``make_flash_kernel``, the default): what issue 18 asks of an SDPA-class kernel.

- **Several query heads per block.** A block takes ``rows`` query rows: ``bq`` positions of
  ``heads`` query heads of one GQA group (``heads`` divides the group). The group shares one
  key/value head, so each K/V tile loaded into shared memory serves all of them, and a block's
  causal extent is ``bq`` positions, not ``rows``: the diagonal costs less.
- **Two register-blocked GEMMs with one exp per score.** Scores: thread (rg, kg) computes a
  ``tr x tk`` tile of S = Q K^T (rows in runs of 4: one 128-bit shared load of Q per d, one
  ``tk``-wide load of K), so a score costs ``(tr + tk) / (tr * tk)`` shared loads per FMA instead
  of 1. Its row maxima meet in shared memory (the simulator has no warp shuffles), each score's
  exp is computed once by its owner and stored as P (key-major). Output: thread (og, cg) owns a
  ``to x hd/ncg`` tile of O and adds ``P[j, rows] (x) V[j, cols]``, one 128-bit load of P and
  ``hd/ncg/4`` of V per ``to * hd/ncg`` FMAs. The running sum ``l`` stays per thread (partial over
  its keys, rescaled with the shared running max) and is summed once at the end.
- **Causal tile schedule.** A block walks key tiles up to its diagonal only; the tiles wholly
  below the diagonal (``k0 + bkv <= q0 + 1``) skip the mask and the bounds checks (one
  block-uniform branch), the diagonal tiles (and the last, ragged one) take them. Query tiles
  run longest first (block x counts down) to even out the tail.
- **Split-KV.** With ``splits`` > 1 a query tile's key tiles are shared among that many blocks
  (equal shares); each writes its partial output normalised by its own sum, and its
  log-sum-exp; a small combine kernel merges them (``o = sum_s w_s o_s / sum_s w_s``,
  ``w_s = exp(lse_s - max lse)``). Split 0 writes into ``o`` itself and the combine works in
  place, so the workspace holds ``splits - 1`` partial outputs and ``splits`` lse planes
  (:func:`workspace_size`). It adds blocks when ``ceil(T / bq) * nh / heads * B`` would not fill
  the GPU (:func:`choose`).

Per key tile a block runs 4 barriers: K stored (transposed, conflict-free: 8 d x 4 keys per
warp), scores and row maxima written, P and V stored (K and V share one shared buffer: with
Q, P and the maxima everything fits in the 48 KiB of static shared memory at hd = 128), P @ V done.
Global loads of the next K tile and of this tile's V are issued into registers before the
barriers that precede their use.

Switches of :class:`FlashTiles` (``dbuf`` and ``pv_dbuf`` on by default since the H200 timed
them, ``exp2`` off; ``scripts/sass_report.py attention`` shows their SASS): ``dbuf`` / ``pv_dbuf`` load the next d step's (key's)
register fragments while the current step's FMAs run, across the loop's back edge (ptxas already
hoists the loads inside one unrolled iteration, so the FMAs at the top of each iteration waited
on shared-memory latency with only 2 warps per scheduler); ``exp2`` folds log2(e) into Q's
scale so that each exp is one ``exp2`` (MUFU.EX2 plus its denormal guard) instead of expf's
range reduction, and turns the max back into natural-log units for ``lse``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint64

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, check_ndim, simulating, sm_count

STATIC_SHARED_LIMIT = 48 * 1024
NEG_INF = float32(-np.inf)


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape of variant 1. Defaults (H200, hd = 128): 32 queries x 16 keys per step, 128
    threads, each owning 2 query rows and hd/8 = 16 output columns (32 accumulators); 36 KiB of
    shared memory, so several blocks share an SM."""

    bq: int = 32  # query rows per block
    bkv: int = 16  # keys per step
    rm: int = 2  # query rows per thread
    tpr: int = 8  # threads per group of rows (split keys in step 2, output columns in step 3)

    @property
    def threads(self) -> int:
        return (self.bq // self.rm) * self.tpr

    def shared_bytes(self, hd: int) -> int:
        return 4 * (hd * (self.bq + 1) + hd * (self.bkv + 1) + self.bkv * hd
                    + self.bq * (self.bkv + 1))

    def check(self, hd: int) -> None:
        if self.bq % self.rm or self.bkv % self.tpr or hd % self.tpr:
            raise KernelError(
                f"attention tiles {self} with head_dim={hd}: need bq % rm == 0, "
                f"bkv % tpr == 0 and head_dim % tpr == 0"
            )
        if self.shared_bytes(hd) > STATIC_SHARED_LIMIT:
            raise KernelError(
                f"attention tiles {self} with head_dim={hd} need {self.shared_bytes(hd)} bytes "
                f"of shared memory (> {STATIC_SHARED_LIMIT})"
            )
        if self.threads > 1024:
            raise KernelError(f"attention tiles {self} need {self.threads} threads (> 1024)")


# Simulator: 8 threads per block, 8 queries x 4 keys per step.
SIM_TILES = AttentionTiles(bq=8, bkv=4, rm=2, tpr=2)

@lru_cache(maxsize=None)
def make_attention_kernel(hd: int, tiles: AttentionTiles, with_lse: bool = False):
    """The kernel for head_dim ``hd``; ``with_lse`` also writes each row's log-sum-exp of the
    scaled scores into ``lse`` (B, nh, T), the statistics the backward recomputes P from."""
    tiles.check(hd)
    WITH_LSE = with_lse
    HD, BQ, BKV, RM, TPR = hd, tiles.bq, tiles.bkv, tiles.rm, tiles.tpr
    NRG = BQ // RM
    NT = NRG * TPR
    KPT = BKV // TPR  # keys per thread in step 2
    CPT = HD // TPR  # output columns per thread in step 3
    BQP, BKVP = BQ + 1, BKV + 1  # padded row lengths (compile-time constants)
    Q_LOADS = -(-BQ * HD // NT)
    KV_LOADS = -(-BKV * HD // NT)

    @fastlaunch.jit
    def attention_kernel(q, k, v, o, scale, lse):
        t_ = q.shape[1]
        group = q.shape[2] // k.shape[2]
        n_qt = (t_ + BQ - 1) // BQ
        qt = n_qt - 1 - cuda.blockIdx.x  # longest tiles first
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // group
        q0 = qt * BQ
        QsT = cuda.shared.array((HD, BQP), float32)  # (hd, bq) scaled queries, d-major
        KsT = cuda.shared.array((HD, BKVP), float32)  # (hd, bkv) keys, d-major
        Vs = cuda.shared.array((BKV, HD), float32)  # (bkv, hd) values
        Ps = cuda.shared.array((BQ, BKVP), float32)  # (bq, bkv) masked scores
        acc = cuda.local.array((RM, CPT), float32)  # (rm, hd/tpr) unnormalised output
        m_i = cuda.local.array(RM, float32)  # running max per row
        l_i = cuda.local.array(RM, float32)  # running sum of exp per row
        s_reg = cuda.local.array((RM, KPT), float32)  # (rm, bkv/tpr) scores
        a_reg = cuda.local.array(RM, float32)
        b_reg = cuda.local.array(KPT, float32)
        tid = cuda.threadIdx.x
        rg = tid // TPR
        lane = tid % TPR

        for l in range(Q_LOADS):
            e = tid + l * NT
            if e < BQ * HD:
                r = e // HD
                d = e % HD
                val = float32(0.0)
                if q0 + r < t_:
                    val = q[b, q0 + r, h, d] * scale
                QsT[d, r] = val
        for i in range(RM):
            m_i[i] = NEG_INF
            l_i[i] = float32(0.0)
            for c in range(CPT):
                acc[i, c] = float32(0.0)

        kv_end = min(t_, q0 + BQ)  # the last row of the tile sees keys < q0 + bq
        for k0 in range(0, kv_end, BKV):
            # 1. stage the key/value tile
            for l in range(KV_LOADS):
                e = tid + l * NT
                if e < BKV * HD:
                    r = e // HD
                    d = e % HD
                    kval = float32(0.0)
                    vval = float32(0.0)
                    if k0 + r < t_:
                        kval = k[b, k0 + r, hk, d]
                        vval = v[b, k0 + r, hk, d]
                    KsT[d, r] = kval
                    Vs[r, d] = vval
            cuda.syncthreads()
            # 2. scores of this thread's (rm, bkv/tpr) register tile
            for i in range(RM):
                for j in range(KPT):
                    s_reg[i, j] = float32(0.0)
            for d in range(HD):
                for i in range(RM):
                    a_reg[i] = QsT[d, rg + i * NRG]
                for j in range(KPT):
                    b_reg[j] = KsT[d, lane + j * TPR]
                for i in range(RM):
                    for j in range(KPT):
                        s_reg[i, j] += a_reg[i] * b_reg[j]
            for i in range(RM):
                row = q0 + rg + i * NRG
                for j in range(KPT):
                    key = k0 + lane + j * TPR
                    val = s_reg[i, j]
                    if key > row or key >= t_:
                        val = NEG_INF
                    Ps[rg + i * NRG, lane + j * TPR] = val
            cuda.syncthreads()
            # 3. online softmax update and P @ V on this thread's output columns
            for i in range(RM):
                r = rg + i * NRG
                mt = m_i[i]
                for j in range(BKV):
                    mt = max(mt, Ps[r, j])
                alpha = math.exp(m_i[i] - mt)  # 0 on the first tile (m_i = -inf)
                m_i[i] = mt
                l_i[i] *= alpha
                for c in range(CPT):
                    acc[i, c] *= alpha
            for j in range(BKV):
                for i in range(RM):
                    p = math.exp(Ps[rg + i * NRG, j] - m_i[i])
                    l_i[i] += p
                    for c in range(CPT):
                        acc[i, c] += p * Vs[j, lane + c * TPR]
            cuda.syncthreads()

        for i in range(RM):
            row = q0 + rg + i * NRG
            if row < t_:
                inv = float32(1.0) / l_i[i]
                for c in range(CPT):
                    o[b, row, h, lane + c * TPR] = acc[i, c] * inv
                if WITH_LSE and lane == 0:
                    lse[b, h, row] = m_i[i] + math.log(l_i[i])

    return attention_kernel



# ---- variant 2 ------------------------------------------------------------------------------

PAD = 4  # shared row padding (words): rows stay 16-byte aligned for 128-bit loads


def _runs(n: int) -> int:
    """A thread's rows / columns come in runs of 4 adjacent ones when it has a multiple of 4
    (one 128-bit shared load per run), else one by one."""
    return 4 if n % 4 == 0 else 1


def _fetch_shape(hd: int, threads: int, width: int) -> tuple[int, int]:
    """(d per pass, keys per pass) of a tile load whose warps read ``width`` adjacent d of each
    key: the largest of ``width``, ..., 1 dividing both hd and the threads."""
    dw = math.gcd(width, math.gcd(hd, threads))
    return dw, threads // dw


@dataclass(frozen=True)
class FlashTiles:
    """Tile shape of variant 2. ``rows`` query rows per block (``bq = rows / heads`` positions
    of ``heads`` query heads; fewer heads when the GQA group is smaller), key tiles of ``bkv``;
    scores as ``tr x tk`` per thread, the output as ``to x hd/ncg`` per thread.

    Defaults (H200, hd = 128): 32 rows (8 positions x 4 heads), 32 keys per tile, 64 threads;
    scores 4 x 4 per thread (16 FMAs per 2 shared loads), output 4 x 16 per thread; no register
    cap needed (64 threads); both loops' register fragments double-buffered (``dbuf``,
    ``pv_dbuf``). Measured on the H200 against the first defaults (4 x 2 scores, 128 threads) and
    other shapes (``experiments/results/kernels-h200/run3-ncu/``): 1.58x SDPA's time at T = 4096
    and 8192 against 1.76-1.78x, equal at T = 1024 and 2048 (1.81-1.84x); then (``run4/``) the
    double buffering took T = 1024 / 2048 / 4096 from 1.90 / 1.80 / 1.57x to 1.80 / 1.73 / 1.49x,
    output equal to SDPA's to 6.2e-7."""

    rows: int = 32  # query rows per block (positions x heads)
    heads: int = 4  # at most this many query heads of one group per block
    bkv: int = 32  # keys per tile
    tr: int = 4  # score rows per thread
    tk: int = 4  # score keys per thread (adjacent)
    to: int = 4  # output rows per thread
    blocks_per_sm: int = 4  # registers are capped so that this many blocks fit an SM (0: no cap)
    dbuf: bool = True  # double-buffer the score loop's register fragments (head_dim % 4 == 0)
    pv_dbuf: bool = True  # double-buffer the P @ V loop's register fragments
    exp2: bool = False  # softmax in base 2: log2(e) folded into Q's scale, exp2 per score

    @property
    def threads(self) -> int:
        return (self.rows // self.tr) * (self.bkv // self.tk)

    def out_cols(self, hd: int) -> int:
        """Output columns per thread."""
        groups = self.threads * self.to // self.rows  # column groups of the output phase
        return hd // groups

    def heads_for(self, group: int) -> int:
        """Query heads per block for a GQA group of ``group`` heads: the largest divisor of the
        group that is at most ``heads`` and divides ``rows``."""
        for g in range(min(self.heads, group), 0, -1):
            if group % g == 0 and self.rows % g == 0:
                return g
        return 1

    def shared_bytes(self, hd: int) -> int:
        kv = max(hd * (self.bkv + PAD), self.bkv * (hd + PAD))  # K (d-major) or V (key-major)
        return 4 * (hd * (self.rows + PAD) + kv + self.bkv * (self.rows + PAD)
                    + self.rows * (self.bkv // self.tk) + 3 * self.rows)

    def check(self, hd: int) -> None:
        bad = []
        if self.rows % self.tr or self.bkv % self.tk or self.rows % self.to:
            bad.append("rows % tr, bkv % tk and rows % to must be 0")
        elif (self.threads * self.to) % self.rows or hd % ((self.threads * self.to) // self.rows):
            bad.append(f"head_dim={hd} must split into {(self.threads * self.to) // max(self.rows, 1)} "
                       f"column groups of the output phase")
        if self.bkv % 4:
            bad.append("bkv must be a multiple of 4 (the P @ V loop is unrolled by 4)")
        for width in (8, 32):
            dw, kw = _fetch_shape(hd, self.threads, width)
            if self.bkv % kw:
                bad.append(f"bkv={self.bkv} must be a multiple of the {kw} keys a tile load covers per pass")
        if self.shared_bytes(hd) > STATIC_SHARED_LIMIT:
            bad.append(f"needs {self.shared_bytes(hd)} bytes of shared memory (> {STATIC_SHARED_LIMIT})")
        if self.threads > 1024:
            bad.append(f"needs {self.threads} threads (> 1024)")
        if bad:
            raise KernelError(f"attention tiles {self} with head_dim={hd}: " + "; ".join(bad))


# Simulator: 8 threads, 8 rows (4 positions x 2 heads), 4 keys per tile.
SIM_FLASH_TILES = FlashTiles(rows=8, heads=2, bkv=4, tr=2, tk=2, to=2)

# Candidates beside the default (experiments/kernels_bench.py times them). H200, run4, time /
# SDPA's at T = 1024 / 2048 / 4096 (T = 8192 cut by the call's limit), against the default's
# 1.80 / 1.73 / 1.49 (and 1.90 / 1.80 / 1.57 without double buffering):
#   exp2                              1.79 / 1.71 / 1.48  (row statistics in base 2, turned back for lse)
#   exp2, 200-register cap (5 blocks) 1.85 / 1.77 / 1.53
#   the same with 4 x 8 output tiles  1.80 / 1.72 / 1.47
# exp2 is within 1% of the default and changes how ``lse`` is computed, which the H200 has not
# checked through the backward; the cap costs more than the extra block gains.
FLASH_CANDIDATES = (
    FlashTiles(dbuf=False, pv_dbuf=False),  # the previous default
    FlashTiles(exp2=True),
    FlashTiles(blocks_per_sm=5, exp2=True),
    FlashTiles(to=8, blocks_per_sm=5, dbuf=True, pv_dbuf=True, exp2=True),
)


def _step(load, fma):
    """A device function ``step(X, Y, j, r, c, acc, a, b)``: ``load`` step j's fragments into
    (a, b), then ``fma`` them into ``acc`` (the loops of :func:`_double_buffered`, one step at a
    time)."""

    @cuda.jit(device=True, inline="always")
    def step(X, Y, j, r, c, acc, a, b):
        load(X, Y, j, r, c, a, b)
        fma(acc, a, b)

    return step


def _double_buffered(load, fma, n: int):
    """A device function ``run(X, Y, r, c, acc, a, b, a2, b2)`` adding ``fma(acc, fragments of
    step j)`` over steps j = 0 .. n - 1, where ``load(X, Y, j, r, c, a, b)`` fetches step j's
    fragments from shared memory: register double buffering, step j + 1's fragments loaded into
    the other set (a2, b2 or a, b) while step j's FMAs run, across the loop's back edge too (the
    last 4 steps are peeled so that no load runs past n - 1; n % 4 == 0). The score loop (over d)
    and the P @ V loop (over keys) of variant 2 are two such loops."""

    @cuda.jit(device=True, inline="always")
    def pair(X, Y, j, r, c, acc, a, b, a2, b2):
        """Steps j and j + 1, step j's fragments in (a, b) on entry, step j + 2's on exit."""
        load(X, Y, j + uint64(1), r, c, a2, b2)
        fma(acc, a, b)
        load(X, Y, j + uint64(2), r, c, a, b)
        fma(acc, a2, b2)

    @cuda.jit(device=True, inline="always")
    def run(X, Y, r, c, acc, a, b, a2, b2):
        load(X, Y, uint64(0), r, c, a, b)
        for j4 in range(0, n - 4, 4):
            pair(X, Y, uint64(j4), r, c, acc, a, b, a2, b2)
            pair(X, Y, uint64(j4 + 2), r, c, acc, a, b, a2, b2)
        pair(X, Y, uint64(n - 4), r, c, acc, a, b, a2, b2)
        load(X, Y, uint64(n - 1), r, c, a2, b2)
        fma(acc, a, b)
        fma(acc, a2, b2)

    return run


@lru_cache(maxsize=None)
def make_flash_kernel(hd: int, tiles: FlashTiles, heads: int, with_lse: bool = False):
    """Variant 2 for head_dim ``hd`` and ``heads`` query heads per block (see the module
    docstring). Kernel arguments: q, k, v, o, scale, lse, ws_o, ws_lse, n_splits."""
    tiles.check(hd)
    if tiles.rows % heads:
        raise KernelError(f"{heads} heads per block do not divide the {tiles.rows} rows of {tiles}")
    HD, R, BKV, TR, TK, TO = hd, tiles.rows, tiles.bkv, tiles.tr, tiles.tk, tiles.to
    HEADS = heads
    BQ = R // HEADS  # positions per block
    NT = tiles.threads
    NKG = BKV // TK  # key groups of the score phase
    NRG = NT // NKG  # row groups of the score phase
    NCG = NT * TO // R  # column groups of the output phase
    NOG = NT // NCG  # row groups of the output phase
    TD = HD // NCG  # output columns per thread
    VR, VO, VC = _runs(TR), _runs(TO), _runs(TD)
    SR, SO, SC = NRG * VR, NOG * VO, NCG * VC  # distance between two runs of one thread
    RP, BKVP, HDP = R + PAD, BKV + PAD, HD + PAD  # padded row lengths of QsT / KsT / Vs and Ps
    KV_WORDS = max(HD * BKVP, BKV * HDP)
    KDW, KKW = _fetch_shape(HD, NT, 8)  # K: 8 d x 4 keys per warp, stored transposed
    VDW, VKW = _fetch_shape(HD, NT, 32)  # V: 32 d of one key per warp
    K_LOADS = (HD // KDW) * (BKV // KKW)  # K (or V) elements per thread per tile
    Q_LOADS = -(-R * HD // NT)
    UD = 4 if HD % 4 == 0 else 1  # the score loop over d is unrolled by 4
    DBUF = tiles.dbuf and HD % 4 == 0
    PV_DBUF = tiles.pv_dbuf
    # exp2: scores in log2 units (Q pre-scaled by scale * log2(e)), so each exp is one MUFU.EX2
    # without expf's range reduction; M_UNIT turns the running max back into natural log units
    EXP2 = tiles.exp2
    Q_UNIT = float32(1.4426950408889634) if EXP2 else float32(1.0)
    M_UNIT = float32(0.6931471805599453) if EXP2 else float32(1.0)
    WITH_LSE = with_lse
    ALIGN = None if simulating() else 16
    # The simulator accepts no register cap.
    opts = {} if simulating() or not tiles.blocks_per_sm else {
        "max_registers": min(255, 65536 // (tiles.blocks_per_sm * NT) // 8 * 8)}

    @cuda.jit(device=True, inline="always")
    def expo(x):
        if EXP2:
            return math.exp2(x)
        return math.exp(x)

    @cuda.jit(device=True, inline="always")
    def s_load(QsT, KV, d, ra, kb, a_reg, k_reg):
        """The fragments of step d: Q[rows, d] and K[keys, d]."""
        for i in range(TR):
            a_reg[i] = QsT[d, ra + uint64((i // VR) * SR + i % VR)]
        for j in range(TK):
            k_reg[j] = KV[d * uint64(BKVP) + kb + uint64(j)]

    @cuda.jit(device=True, inline="always")
    def s_fma(s, a_reg, k_reg):
        for j in range(TK):
            for i in range(TR):
                s[i, j] += a_reg[i] * k_reg[j]

    s_step = _step(s_load, s_fma)  # s += outer(Q[rows, d], K[keys, d])
    s_dbuf = _double_buffered(s_load, s_fma, HD)

    @cuda.jit(device=True, inline="always")
    def scores(QsT, KV, ra, kb, s, a_reg, k_reg, a2, k2):
        for i in range(TR):
            for j in range(TK):
                s[i, j] = float32(0.0)
        if DBUF:
            s_dbuf(QsT, KV, ra, kb, s, a_reg, k_reg, a2, k2)
            return
        for d0 in range(0, HD, UD):
            d = uint64(d0)
            s_step(QsT, KV, d, ra, kb, s, a_reg, k_reg)
            if UD == 4:
                s_step(QsT, KV, d + uint64(1), ra, kb, s, a_reg, k_reg)
                s_step(QsT, KV, d + uint64(2), ra, kb, s, a_reg, k_reg)
                s_step(QsT, KV, d + uint64(3), ra, kb, s, a_reg, k_reg)

    @cuda.jit(device=True, inline="always")
    def pv_load(Ps, KV, j, ro, cc, p_reg, v_reg):
        """The fragments of key j: P[j, rows] and V[j, cols]."""
        for i in range(TO):
            p_reg[i] = Ps[j, ro + uint64((i // VO) * SO + i % VO)]
        for c in range(TD):
            v_reg[c] = KV[j * uint64(HDP) + cc + uint64((c // VC) * SC + c % VC)]

    @cuda.jit(device=True, inline="always")
    def pv_fma(acc, p_reg, v_reg):
        for c in range(TD):
            for i in range(TO):
                acc[i, c] += p_reg[i] * v_reg[c]

    pv_step = _step(pv_load, pv_fma)  # acc += outer(P[key j, rows], V[key j, cols])
    pv_dbuf = _double_buffered(pv_load, pv_fma, BKV)

    @cuda.jit(device=True, inline="always")
    def fetch_kv(src, b, hk, k0, T, dw, kw, tid, pf):
        """pf <- this thread's K or V elements of keys [k0, k0 + BKV): d ``tid % dw + dw * x``,
        key ``tid // dw + kw * y``; zero past T (only the last tile checks)."""
        d0 = uint64(tid % dw)
        key0 = uint64(tid // dw)
        nd = HD // dw
        if k0 + uint64(BKV) <= T:
            for l in range(K_LOADS):
                pf[l] = src[b, k0 + key0 + uint64((l // nd) * kw), hk, d0 + uint64((l % nd) * dw)]
        else:
            for l in range(K_LOADS):
                key = k0 + key0 + uint64((l // nd) * kw)
                val = float32(0.0)
                if key < T:
                    val = src[b, key, hk, d0 + uint64((l % nd) * dw)]
                pf[l] = val

    @cuda.jit(device=True, inline="always")
    def stash_kv(KV, tid, pf, dw, kw, sd, sk):
        """KV[d * sd + key * sk] <- pf, as fetched by fetch_kv(dw, kw): K^T (sd = BKVP, sk = 1)
        or V (sd = 1, sk = HDP)."""
        d0 = uint64(tid % dw)
        key0 = uint64(tid // dw)
        nd = HD // dw
        for l in range(K_LOADS):
            d = d0 + uint64((l % nd) * dw)
            key = key0 + uint64((l // nd) * kw)
            KV[d * uint64(sd) + key * uint64(sk)] = pf[l]

    @fastlaunch.jit(**opts)
    def flash_kernel(q, k, v, o, scale, lse, ws_o, ws_lse, n_splits):
        T = uint64(q.shape[1])
        group = q.shape[2] // k.shape[2]
        sub = group // HEADS  # blocks per key/value head
        n_qt = (T + uint64(BQ - 1)) // uint64(BQ)
        bx = uint64(cuda.blockIdx.x)
        ns = uint64(n_splits)
        qt = n_qt - uint64(1) - bx // ns  # longest query tiles first
        split = bx % ns
        hk = cuda.blockIdx.y // sub
        h0 = hk * group + (cuda.blockIdx.y % sub) * HEADS
        b = cuda.blockIdx.z
        q0 = qt * uint64(BQ)
        kv_end = min(T, q0 + uint64(BQ))  # keys the last position of the tile sees
        n_tiles = (kv_end + uint64(BKV - 1)) // uint64(BKV)
        per = (n_tiles + ns - uint64(1)) // ns
        t0 = split * per
        t1 = min(n_tiles, t0 + per)

        QsT = cuda.shared.array((HD, RP), float32, alignment=ALIGN)  # (hd, rows) scaled Q
        KV = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)  # K^T (hd, bkv) or V (bkv, hd)
        Ps = cuda.shared.array((BKV, RP), float32, alignment=ALIGN)  # (bkv, rows) probabilities
        Red = cuda.shared.array((R, NKG), float32)  # per-row partial maxima, then sums
        Alpha = cuda.shared.array(R, float32)  # per-row rescale of this tile
        Mfin = cuda.shared.array(R, float32)  # per-row final max
        s = cuda.local.array((TR, TK), float32)  # (tr, tk) scores, then probabilities
        a_reg = cuda.local.array(TR, float32)
        k_reg = cuda.local.array(TK, float32)
        a2 = cuda.local.array(TR, float32)  # the second fragment buffer (DBUF)
        k2 = cuda.local.array(TK, float32)
        m_i = cuda.local.array(TR, float32)  # running max of the score rows
        l_i = cuda.local.array(TR, float32)  # running partial sum over this thread's keys
        acc = cuda.local.array((TO, TD), float32)  # (to, td) unnormalised output
        p_reg = cuda.local.array(TO, float32)
        v_reg = cuda.local.array(TD, float32)
        p2 = cuda.local.array(TO, float32)  # the second fragment buffers (PV_DBUF)
        v2 = cuda.local.array(TD, float32)
        pf = cuda.local.array(K_LOADS, float32)  # the next K or V tile, in flight
        tid = cuda.threadIdx.x
        kg = tid % NKG  # score phase: key group and row group
        ra = uint64((tid // NKG) * VR)
        kb = uint64(kg * TK)
        cg = tid % NCG  # output phase: column group and row group
        ro = uint64((tid // NCG) * VO)
        cc = uint64(cg * VC)

        # Q tile: row r is position q0 + r % BQ of head h0 + r // BQ; zero past T
        qscale = scale * Q_UNIT
        for l in range(Q_LOADS):
            e = tid + l * NT
            if e < R * HD:
                r = e // HD
                d = e % HD
                pos = q0 + uint64(r % BQ)
                val = float32(0.0)
                if pos < T:
                    val = q[b, pos, h0 + r // BQ, d] * qscale
                QsT[d, r] = val
        for i in range(TR):
            m_i[i] = NEG_INF
            l_i[i] = float32(0.0)
        for i in range(TO):
            for c in range(TD):
                acc[i, c] = float32(0.0)

        if t0 < t1:
            fetch_kv(k, b, hk, t0 * uint64(BKV), T, KDW, KKW, tid, pf)
        for t in range(t0, t1):
            k0 = t * uint64(BKV)
            stash_kv(KV, tid, pf, KDW, KKW, BKVP, 1)
            cuda.syncthreads()
            # scores; the diagonal (and ragged last) tiles mask key > position and key >= T
            scores(QsT, KV, ra, kb, s, a_reg, k_reg, a2, k2)
            if k0 + uint64(BKV) > q0 + uint64(1):
                for i in range(TR):
                    pos = q0 + uint64((ra + uint64((i // VR) * SR + i % VR)) % uint64(BQ))
                    for j in range(TK):
                        key = k0 + kb + uint64(j)
                        if key > pos or key >= T:
                            s[i, j] = NEG_INF
            for i in range(TR):
                mx = s[i, 0]
                for j in range(1, TK):
                    mx = max(mx, s[i, j])
                Red[ra + uint64((i // VR) * SR + i % VR), kg] = mx
            fetch_kv(v, b, hk, k0, T, VDW, VKW, tid, pf)
            cuda.syncthreads()
            # online softmax: new running max, this tile's probabilities and rescale
            for i in range(TR):
                r = ra + uint64((i // VR) * SR + i % VR)
                mt = m_i[i]
                for g in range(NKG):
                    mt = max(mt, Red[r, g])
                alpha = float32(1.0)
                if mt == NEG_INF:  # every key so far masked (a later split's first rows)
                    for j in range(TK):
                        s[i, j] = float32(0.0)
                else:
                    alpha = expo(m_i[i] - mt)  # 0 on the first tile (m_i = -inf)
                    for j in range(TK):
                        s[i, j] = expo(s[i, j] - mt)
                m_i[i] = mt
                tot = l_i[i] * alpha
                for j in range(TK):
                    tot += s[i, j]
                    Ps[kb + uint64(j), r] = s[i, j]
                l_i[i] = tot
                if kg == 0:
                    Alpha[r] = alpha
            stash_kv(KV, tid, pf, VDW, VKW, 1, HDP)  # K was last read before the previous barrier
            if t + uint64(1) < t1:
                fetch_kv(k, b, hk, k0 + uint64(BKV), T, KDW, KKW, tid, pf)
            cuda.syncthreads()
            # O = O * alpha + P V
            for i in range(TO):
                a = Alpha[ro + uint64((i // VO) * SO + i % VO)]
                for c in range(TD):
                    acc[i, c] *= a
            if PV_DBUF:
                pv_dbuf(Ps, KV, ro, cc, acc, p_reg, v_reg, p2, v2)
            else:
                for j4 in range(0, BKV, 4):
                    j = uint64(j4)
                    pv_step(Ps, KV, j, ro, cc, acc, p_reg, v_reg)
                    pv_step(Ps, KV, j + uint64(1), ro, cc, acc, p_reg, v_reg)
                    pv_step(Ps, KV, j + uint64(2), ro, cc, acc, p_reg, v_reg)
                    pv_step(Ps, KV, j + uint64(3), ro, cc, acc, p_reg, v_reg)
            cuda.syncthreads()

        # row sums (partial per key group) and maxima -> the output threads
        for i in range(TR):
            r = ra + uint64((i // VR) * SR + i % VR)
            Red[r, kg] = l_i[i]
            if kg == 0:
                Mfin[r] = m_i[i]
        cuda.syncthreads()
        for i in range(TO):
            r = ro + uint64((i // VO) * SO + i % VO)
            pos = q0 + r % uint64(BQ)
            if pos < T:
                h = h0 + int64(r // uint64(BQ))
                tot = float32(0.0)
                for g in range(NKG):
                    tot += Red[r, g]
                inv = float32(0.0)
                row_lse = NEG_INF
                if tot > float32(0.0):
                    inv = float32(1.0) / tot
                    row_lse = Mfin[r] * M_UNIT + math.log(tot)
                for c in range(TD):
                    col = cc + uint64((c // VC) * SC + c % VC)
                    if split == uint64(0):
                        o[b, pos, h, col] = acc[i, c] * inv
                    else:
                        ws_o[split - uint64(1), b, pos, h, col] = acc[i, c] * inv
                if cg == 0:
                    if ns > uint64(1):
                        ws_lse[split, b, h, pos] = row_lse
                    elif WITH_LSE:
                        lse[b, h, pos] = row_lse

    return flash_kernel


@fastlaunch.jit
def _combine_splits(o, ws_o, ws_lse, lse, n_splits, with_lse):
    """o <- the splits' partial outputs merged by their log-sum-exps (split 0 is in o already);
    one thread per output element, grid-stride."""
    b_, t_, nh, hd = o.shape
    n = b_ * t_ * nh * hd
    start, step = cuda.grid(1), cuda.gridsize(1)
    for e in range(start, n, step):
        d = e % hd
        h = (e // hd) % nh
        t = (e // (hd * nh)) % t_
        b = e // (hd * nh * t_)
        mx = ws_lse[0, b, h, t]
        for s in range(1, n_splits):
            mx = max(mx, ws_lse[s, b, h, t])
        w = math.exp(ws_lse[0, b, h, t] - mx)  # split 0 always holds key 0: mx is finite
        tot = w
        val = w * o[b, t, h, d]
        for s in range(1, n_splits):
            w = math.exp(ws_lse[s, b, h, t] - mx)
            tot += w
            val += w * ws_o[s - 1, b, t, h, d]
        o[b, t, h, d] = val / tot
        if with_lse and d == 0:
            lse[b, h, t] = mx + math.log(tot)


def workspace_size(b: int, t: int, nh: int, hd: int, splits: int) -> int:
    """float32 elements of the split-KV workspace: ``splits - 1`` partial outputs (B, T, nh, hd)
    and ``splits`` lse planes (B, nh, T); 0 without splitting."""
    if splits <= 1:
        return 0
    return (splits - 1) * b * t * nh * hd + splits * b * nh * t


# ---- launch rule and launcher ---------------------------------------------------------------

MAX_SPLITS = 8
# Split-KV adds blocks while a launch has fewer than this many (two per SM of the H200). Not
# yet measured: experiments/kernels_bench.py times splits 1, 2 and 4 beside the rule's choice.
# Under the simulator, where every block is slow and none run in parallel, only tiny launches split.
SPLIT_MIN_BLOCKS_PER_SM = 2  # split KV until about this many blocks per SM of the device
SPLIT_MIN_BLOCKS_SIM = 4


@dataclass(frozen=True)
class AttentionLaunch:
    """What the launcher runs: a variant, its tiles, the query heads per block (variant 2) and
    the split-KV count."""

    variant: int
    tiles: AttentionTiles | FlashTiles
    heads: int = 1
    splits: int = 1


def choose_tiles(hd: int) -> AttentionTiles:
    """Variant 1's launch shape for head_dim ``hd``: the simulator's tiny tiles, else the H200
    defaults with ``tpr`` lowered until it divides ``hd``."""
    base = SIM_TILES if simulating() else AttentionTiles()
    tpr = base.tpr
    while hd % tpr:
        tpr //= 2
    return AttentionTiles(bq=base.bq, bkv=base.bkv, rm=base.rm, tpr=tpr)


def default_flash_tiles(hd: int) -> FlashTiles | None:
    """Variant 2's tiles for head_dim ``hd``: on a GPU the H200 defaults, or for a head_dim they
    do not fit (not a multiple of 16, or too wide) the simulator's tiny ones; None when neither
    fits (then variant 1 runs)."""
    for tiles in ((SIM_FLASH_TILES,) if simulating() else (FlashTiles(), SIM_FLASH_TILES)):
        try:
            tiles.check(hd)
        except ValueError:
            continue
        return tiles
    return None


def _split_count(tiles: FlashTiles, heads: int, b: int, t: int, nh: int) -> int:
    """Splits that bring a launch to SPLIT_MIN_BLOCKS_PER_SM blocks per SM, at most MAX_SPLITS and at most
    the longest query tile's key tiles."""
    bq = tiles.rows // heads
    blocks = -(-t // bq) * (nh // heads) * b
    target = SPLIT_MIN_BLOCKS_SIM if simulating() else SPLIT_MIN_BLOCKS_PER_SM * sm_count()
    if blocks >= target:
        return 1
    return max(1, min(MAX_SPLITS, -(-target // blocks), -(-t // tiles.bkv)))


DEFAULT_VARIANT = 2
"""The kernel ``attention()`` launches unless told: variant 2 (several heads per block, causal
tile schedule, split-KV). On the H200 its output equals SDPA's to 1.1e-6 at T = 1024-8192, at
1.5-1.8x SDPA's time against variant 1's 6.5x (``experiments/results/kernels-h200/run3-ncu/``,
``run4/``). ``tests/gpu/test_train_kernels_gpu.py`` passed with variant 2 at the 4 x 2 tiles, and
its forward, row-statistics and backward cases passed again at the 4 x 4 tiles (the two
whole-training-step cases were cut by that call's limit); the double-buffered loops are checked
against SDPA's output only. Variant 1 stays for head dims variant 2's tiles do not fit."""


def choose(b: int, t: int, nh: int, nkv: int, hd: int, variant: int | None = None,
           tiles=None, splits: int | None = None) -> AttentionLaunch:
    """The launch for a problem; whatever of ``variant`` / ``tiles`` / ``splits`` is given is
    kept. :data:`DEFAULT_VARIANT` unless asked otherwise (variant 1 where variant 2's tiles do not
    fit ``hd``)."""
    if isinstance(tiles, AttentionTiles):
        variant = 1 if variant is None else variant
    elif isinstance(tiles, FlashTiles):
        variant = 2 if variant is None else variant
    if variant is None and splits is not None and splits > 1:
        variant = 2  # only variant 2 splits
    if variant is None:
        variant = DEFAULT_VARIANT if default_flash_tiles(hd) is not None else 1
    if variant not in (1, 2):
        raise KernelError(f"unknown attention variant {variant}; known: 1, 2")
    if variant == 1:
        if tiles is not None and not isinstance(tiles, AttentionTiles):
            raise KernelError(f"attention variant 1 takes AttentionTiles, got {tiles}")
        if splits not in (None, 1):
            raise KernelError(f"attention variant 1 has no split-KV; splits={splits} needs variant 2")
        return AttentionLaunch(1, tiles or choose_tiles(hd))
    if tiles is not None and not isinstance(tiles, FlashTiles):
        raise KernelError(f"attention variant 2 takes FlashTiles, got {tiles}")
    tiles = tiles or default_flash_tiles(hd)
    if tiles is None:
        raise KernelError(f"attention variant 2 has no default tiles for head_dim={hd}")
    heads = tiles.heads_for(nh // nkv)
    if splits is None:
        splits = _split_count(tiles, heads, b, t, nh)
    if splits < 1:
        raise KernelError(f"attention: splits={splits} must be at least 1")
    return AttentionLaunch(2, tiles, heads, splits)


def check_args(q, k, v, o) -> tuple[int, int, int, int, int]:
    for name, a in (("q", q), ("k", k), ("v", v), ("attention output", o)):
        check_float32(name, a)
        check_ndim(name, a, 4)
    b, t, nh, hd = q.shape
    bk, tk, nkv, hdk = k.shape
    if (bk, tk, hdk) != (b, t, hd) or tuple(v.shape) != tuple(k.shape):
        raise KernelError(
            f"attention: q {tuple(q.shape)} (B, T, nh, hd), k {tuple(k.shape)} and v "
            f"{tuple(v.shape)} (B, T, nkv, hd) disagree"
        )
    if nkv == 0 or nh % nkv:
        raise KernelError(f"attention: n_heads={nh} is not a multiple of n_kv_heads={nkv}")
    if tuple(o.shape) != tuple(q.shape):
        raise KernelError(f"attention: output {tuple(o.shape)} != q {tuple(q.shape)}")
    return b, t, nh, nkv, hd


def workspace_for(b: int, t: int, nh: int, nkv: int, hd: int, stream=0, **launch):
    """A device workspace for what :func:`choose` picks (with ``launch`` overrides), or None
    when it does not split. For callers that launch repeatedly and allocate nothing per call."""
    n = workspace_size(b, t, nh, hd, choose(b, t, nh, nkv, hd, **launch).splits)
    return cuda.device_array(n, dtype=np.float32, stream=stream) if n else None


def attention(q, k, v, o, stream=0, tiles: AttentionTiles | FlashTiles | None = None, lse=None,
              variant: int | None = None, splits: int | None = None, workspace=None):
    """Enqueue causal attention of q (B, T, nh, hd) over k, v (B, T, nkv, hd) into o; with
    ``lse`` (B, nh, T) also the row statistics that :mod:`attention_backward` needs.

    ``variant`` 1 or 2 (module docstring; default: :func:`choose`), ``tiles`` of that variant,
    ``splits`` key-range splits (variant 2). A split launch needs ``workspace``: a float32
    device array of at least :func:`workspace_size` elements; without one it allocates it
    (``(splits - 1) x`` the size of o), so repeated callers pass their own."""
    b, t, nh, nkv, hd = check_args(q, k, v, o)
    if lse is not None:
        check_float32("lse", lse)
        if tuple(lse.shape) != (b, nh, t):
            raise KernelError(f"attention: lse has shape {tuple(lse.shape)}, expected (B, nh, T) = {(b, nh, t)}")
    launch = choose(b, t, nh, nkv, hd, variant, tiles, splits)
    if b * t * nh == 0:
        return
    scale = np.float32(1.0 / math.sqrt(hd))
    lse_arg = o.reshape(b, t, nh * hd) if lse is None else lse  # a 3-D stand-in, never written
    if launch.variant == 1:
        kernel = make_attention_kernel(hd, launch.tiles, lse is not None)
        kernel[(-(-t // launch.tiles.bq), nh, b), launch.tiles.threads, stream](q, k, v, o, scale, lse_arg)
        return
    tiles, heads, ns = launch.tiles, launch.heads, launch.splits
    kernel = make_flash_kernel(hd, tiles, heads, lse is not None)
    grid = (-(-t // (tiles.rows // heads)) * ns, nkv * (nh // nkv // heads), b)
    if ns == 1:  # stand-ins of the right types, never written
        kernel[grid, tiles.threads, stream](q, k, v, o, scale, lse_arg, o.reshape(1, b, t, nh, hd), o, 1)
        return
    need = workspace_size(b, t, nh, hd, ns)
    if workspace is None:
        workspace = cuda.device_array(need, dtype=np.float32, stream=stream)
    check_float32("attention workspace", workspace)
    if len(workspace.shape) != 1 or workspace.shape[0] < need:
        raise KernelError(f"attention: workspace has shape {tuple(workspace.shape)}, needs at least "
                         f"{need} float32 elements for splits={ns}")
    n_o = (ns - 1) * b * t * nh * hd
    ws_o = workspace[:n_o].reshape(ns - 1, b, t, nh, hd)  # (S-1, B, T, nh, hd)
    ws_lse = workspace[n_o:need].reshape(ns, b, nh, t)  # (S, B, nh, T)
    kernel[grid, tiles.threads, stream](q, k, v, o, scale, lse_arg, ws_o, ws_lse, ns)
    n = b * t * nh * hd
    threads = 32 if simulating() else 256
    blocks = max(1, min(-(-n // threads), 2 if simulating() else 132 * 16))
    _combine_splits[blocks, threads, stream](o, ws_o, ws_lse, lse_arg, ns, lse is not None)


def validate(
    shapes=((1, 5, 2, 2, 4), (2, 9, 4, 2, 8), (1, 17, 3, 1, 6), (1, 8, 2, 2, 4), (1, 1, 4, 1, 4)),
    tiles: AttentionTiles | FlashTiles | None = None,
    rtol: float = 1e-5,
    seed: int = 0,
    variant: int | None = None,
    splits: int | None = None,
    with_lse: bool = True,
) -> list[dict]:
    """Each shape is (B, T, nh, nkv, hd): ragged T, GQA and multi-head cases, T = 1. Checks o
    and (``with_lse``) the row statistics against ``reference.attention_lse``."""
    rng = np.random.default_rng(seed)
    records = []
    for b, t, nh, nkv, hd in shapes:
        q = rng.standard_normal((b, t, nh, hd), dtype=np.float32)  # (B, T, nh, hd)
        k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)  # (B, T, nkv, hd)
        v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)  # (B, T, nkv, hd)
        want, want_lse = reference.attention_lse(q, k, v)  # (B, T, nh, hd), (B, nh, T)
        d_o = cuda.device_array(q.shape, dtype=np.float32)
        d_lse = cuda.device_array((b, nh, t), dtype=np.float32) if with_lse else None
        attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), d_o, tiles=tiles, lse=d_lse,
                  variant=variant, splits=splits)
        outs = [("o", d_o.copy_to_host(), want)]
        if with_lse:
            outs.append(("lse", d_lse.copy_to_host(), want_lse))
        for name, got, w in outs:
            err = float(np.max(np.abs(got - w)) / np.max(np.abs(w)))
            records.append({"shape": (b, t, nh, nkv, hd), "out": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"attention {name} at (B,T,nh,nkv,hd)={(b, t, nh, nkv, hd)}: "
                                     f"max rel err {err:.3g}")
    return records
