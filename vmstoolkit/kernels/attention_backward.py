"""Backward of causal GQA attention, flash style: the softmax is recomputed tile by tile from
the row statistics ``lse`` (B, nh, T) that the forward saved (``attention(..., lse=)``); no
T x T matrix is ever built.

Inputs q (B, T, nh, hd), k, v (B, T, nkv, hd), o and do (B, T, nh, hd), lse (B, nh, T); outputs
dq (B, T, nh, hd), dk, dv (B, T, nkv, hd). With ``P = exp(q.k / sqrt(hd) - lse)`` (causal) and
``D_i = sum_d do[i, d] o[i, d]``: ``dv_j = sum_i P_ij do_i``, ``dS_ij = P_ij (do_i . v_j - D_i)``,
``dq_i = sum_j dS_ij k_j / sqrt(hd)``, ``dk_j = sum_i dS_ij q_i / sqrt(hd)``.

Recipe: the numpy reference (``reference.attention_backward``), two kernels, a launcher,
``validate()``.

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
local memory (L1). Issue 18 owns attention speed; this is the correct baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from vmstoolkit.errors import KernelError

from . import reference
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

    @cuda.jit
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

    @cuda.jit
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


def attention_backward(q, k, v, o, lse, do, dq, dk, dv, stream=0, tiles: BackwardTiles | None = None):
    """Enqueue the gradients dq, dk, dv of causal attention (shapes in the module docstring)."""
    b, t, nh, nkv, hd = check_args(q, k, v, o)
    for name, a, like in (("do", do, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, k)):
        check_float32(name, a)
        if tuple(a.shape) != tuple(like.shape):
            raise KernelError(f"attention backward: {name} has shape {tuple(a.shape)}, expected {tuple(like.shape)}")
    check_float32("lse", lse)
    check_ndim("lse", lse, 3)
    if tuple(lse.shape) != (b, nh, t):
        raise KernelError(f"attention backward: lse has shape {tuple(lse.shape)}, expected (B, nh, T) = {(b, nh, t)}")
    if b * t * nh == 0:
        return
    tiles = tiles or (SIM_TILES if simulating() else BackwardTiles())
    k_dq, k_dkv = make_backward_kernels(hd, tiles)
    scale = np.float32(1.0 / math.sqrt(hd))
    k_dq[(-(-t // tiles.bq), nh, b), tiles.bq, stream](q, k, v, o, lse, do, dq, scale)
    k_dkv[(-(-t // tiles.bkv), nkv, b), tiles.bkv, stream](q, k, v, o, lse, do, dk, dv, scale)


def validate(shapes=((1, 5, 2, 2, 4), (2, 9, 4, 2, 8), (1, 7, 3, 1, 6)), tiles: BackwardTiles | None = None,
             rtol: float = 1e-5, seed: int = 0) -> list[dict]:
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
        attention_backward(d_q, d_k, d_v, d_o, d_lse, d_do, *outs, tiles=tiles)
        for name, got, w in (("o", d_o, o), ("lse", d_lse, lse), *zip(("dq", "dk", "dv"), outs, want)):
            err = float(np.max(np.abs(got.copy_to_host() - w)) / np.max(np.abs(w)))
            records.append({"shape": (b, t, nh, nkv, hd), "out": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"attention backward {name} at (B,T,nh,nkv,hd)={(b, t, nh, nkv, hd)}: "
                                     f"max rel err {err:.3g}")
    return records
