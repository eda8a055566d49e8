"""Causal attention, tiled with an online softmax (never builds the T x T score matrix).

q (B, T, nh, hd), k and v (B, T, nkv, hd), o (B, T, nh, hd), float32, scale 1/sqrt(hd); query
head h reads key/value head ``h // (nh // nkv)`` (grouped-query attention).

Recipe: the numpy reference (``reference.attention``), the kernel, a launcher, ``validate()``.

One block per (query tile of ``bq`` rows, head, batch). The query tile is staged once in shared
memory (pre-scaled, d-major); the block then walks the key/value tiles of ``bkv`` keys up to the
diagonal (later tiles are all masked and skipped):

1. stage K (d-major) and V (key-major) of the tile in shared memory;
2. scores: thread (rg, lane) computes rows ``rg + i * bq/rm`` x keys ``lane + j * tpr`` (an
   ``rm x bkv/tpr`` register tile), masks (key > query or key >= T) to -inf, writes them to a
   ``bq x bkv`` shared tile;
3. online softmax and P @ V: each thread reads the full score row of each of its rows, gets the
   new running max ``m``, rescales its accumulators by ``exp(m_old - m)``, and adds
   ``exp(s - m) * V`` to the ``rm x hd/tpr`` output columns ``lane + c * tpr`` it owns, keeping
   the running sum ``l``. The ``tpr`` threads of a row recompute the same exps instead of
   exchanging them (the simulator has no warp shuffles, and it costs ``bkv`` exps per row).

At the end ``o = acc / l``. Work per block grows with the query tile's index, so the grid runs
the tiles from the last (longest) to the first to even out the tail.

Shared memory (float32 words): hd*(bq+1) + hd*(bkv+1) + bkv*hd + bq*(bkv+1); the +1 paddings keep
the d-major stores and the strided row reads in distinct banks. It must fit in the 48 KiB of
static shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from . import reference
from ._util import check_float32, check_ndim, simulating

STATIC_SHARED_LIMIT = 48 * 1024
NEG_INF = float32(-np.inf)


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape of the attention kernel. Defaults (H200, hd = 128): 32 queries x 16 keys per
    step, 128 threads, each owning 2 query rows and hd/8 = 16 output columns (32 accumulators);
    36 KiB of shared memory, so several blocks share an SM."""

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
            raise ValueError(
                f"attention tiles {self} with head_dim={hd}: need bq % rm == 0, "
                f"bkv % tpr == 0 and head_dim % tpr == 0"
            )
        if self.shared_bytes(hd) > STATIC_SHARED_LIMIT:
            raise ValueError(
                f"attention tiles {self} with head_dim={hd} need {self.shared_bytes(hd)} bytes "
                f"of shared memory (> {STATIC_SHARED_LIMIT})"
            )
        if self.threads > 1024:
            raise ValueError(f"attention tiles {self} need {self.threads} threads (> 1024)")


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

    @cuda.jit
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


def choose_tiles(hd: int) -> AttentionTiles:
    """Launch shape for head_dim ``hd``: the simulator's tiny tiles, else the H200 defaults with
    ``tpr`` lowered until it divides ``hd``."""
    base = SIM_TILES if simulating() else AttentionTiles()
    tpr = base.tpr
    while hd % tpr:
        tpr //= 2
    return AttentionTiles(bq=base.bq, bkv=base.bkv, rm=base.rm, tpr=tpr)


def check_args(q, k, v, o) -> tuple[int, int, int, int, int]:
    for name, a in (("q", q), ("k", k), ("v", v), ("attention output", o)):
        check_float32(name, a)
        check_ndim(name, a, 4)
    b, t, nh, hd = q.shape
    bk, tk, nkv, hdk = k.shape
    if (bk, tk, hdk) != (b, t, hd) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(
            f"attention: q {tuple(q.shape)} (B, T, nh, hd), k {tuple(k.shape)} and v "
            f"{tuple(v.shape)} (B, T, nkv, hd) disagree"
        )
    if nkv == 0 or nh % nkv:
        raise ValueError(f"attention: n_heads={nh} is not a multiple of n_kv_heads={nkv}")
    if tuple(o.shape) != tuple(q.shape):
        raise ValueError(f"attention: output {tuple(o.shape)} != q {tuple(q.shape)}")
    return b, t, nh, nkv, hd


def attention(q, k, v, o, stream=0, tiles: AttentionTiles | None = None, lse=None):
    """Enqueue causal attention of q (B, T, nh, hd) over k, v (B, T, nkv, hd) into o; with
    ``lse`` (B, nh, T) also the row statistics that :mod:`attention_backward` needs."""
    b, t, nh, _, hd = check_args(q, k, v, o)
    if lse is not None:
        check_float32("lse", lse)
        if tuple(lse.shape) != (b, nh, t):
            raise ValueError(f"attention: lse has shape {tuple(lse.shape)}, expected (B, nh, T) = {(b, nh, t)}")
    if b * t * nh == 0:
        return
    tiles = tiles or choose_tiles(hd)
    kernel = make_attention_kernel(hd, tiles, lse is not None)
    grid = (-(-t // tiles.bq), nh, b)
    if lse is None:
        lse = o.reshape(b, t, nh * hd)  # a 3-D float32 stand-in, never written (one signature)
    kernel[grid, tiles.threads, stream](q, k, v, o, np.float32(1.0 / math.sqrt(hd)), lse)


def validate(
    shapes=((1, 5, 2, 2, 4), (2, 9, 4, 2, 8), (1, 17, 3, 1, 6), (1, 8, 2, 2, 4)),
    tiles: AttentionTiles | None = None,
    rtol: float = 1e-5,
    seed: int = 0,
) -> list[dict]:
    """Each shape is (B, T, nh, nkv, hd): ragged T, GQA and multi-head cases."""
    rng = np.random.default_rng(seed)
    records = []
    for b, t, nh, nkv, hd in shapes:
        q = rng.standard_normal((b, t, nh, hd), dtype=np.float32)  # (B, T, nh, hd)
        k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)  # (B, T, nkv, hd)
        v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)  # (B, T, nkv, hd)
        want = reference.attention(q, k, v)  # (B, T, nh, hd)
        d_o = cuda.device_array(q.shape, dtype=np.float32)
        attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), d_o, tiles=tiles)
        got = d_o.copy_to_host()
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        records.append({"shape": (b, t, nh, nkv, hd), "max_rel_err": err})
        if not err <= rtol:
            raise AssertionError(f"attention at (B,T,nh,nkv,hd)={(b, t, nh, nkv, hd)}: "
                                 f"max rel err {err:.3g}")
    return records
