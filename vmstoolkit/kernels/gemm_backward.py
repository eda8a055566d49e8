"""The GEMMs of ``nn.Linear``'s backward, with their transposed operands: for ``y = x @ w.T``
(x (M, K), w (N, K), y (M, N)),

- ``linear_dx``: ``dx = dy @ w`` (M, K): the weight read as (reduction, output) = (N, K);
- ``linear_dw``: ``dw = dy.T @ x`` (N, K), plus an existing gradient ``acc`` when given: both
  operands read as (reduction, output) = (M, N) and (M, K).

Recipe: the numpy references (``reference.linear_backward_x`` / ``_w``), one kernel factory, two
launchers, ``validate()``.

One register-blocked kernel serves both (and the forward layout): ``C[i, j] = acc[i, j] +
sum_k A(i, k) B(k, j)``, where A is stored (rows, k) ("n") or (k, rows) ("t") and B (cols, k)
("n") or (k, cols) ("t"). It is ``gemm_v2``'s pipeline (``gemm.py``: double-buffered shared
memory, the next k slice prefetched into registers, a ``tm x tn`` micro-tile per thread with
strided rows and columns) with the global loads mapped per layout so that consecutive threads
read consecutive addresses: along k for an "n" operand, along rows / columns for a "t" one.
Shared slices are stored k-major in both cases, so the inner loop is the forward's.

``acc`` may be the output itself (in place) or another array (the runtime's write-once tensors).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, float32

from . import reference
from ._util import check_float32, check_ndim, simulating
from .gemm import PAD, SIM_TILES, GemmTiles

# Tiles on a GPU: gemm.py's v1/v2 shape at 128 x 128 (256 threads, 8 x 8 per thread, k slices
# of 8). Not tuned for the transposed layouts yet (issue 18 tunes the GEMMs on the H200).
GPU_TILES = GemmTiles(bm=128, bn=128, bk=8, tm=8, tn=8)


@lru_cache(maxsize=None)
def make_gemm_tn(t: GemmTiles, a_trans: bool, b_trans: bool, accumulate: bool):
    """``C (R, C) = [acc +] A @ B`` with A stored (R, K) or, ``a_trans``, (K, R), and B stored
    (C, K) or, ``b_trans``, (K, C)."""
    t.check()
    BM, BN, BK, TM, TN = t.bm, t.bn, t.bk, t.tm, t.tn
    NTX, NTY = BN // TN, BM // TM
    NT = NTX * NTY
    A_LOADS, B_LOADS = BM * BK // NT, BN * BK // NT
    BMP, BNP = BM + PAD, BN + PAD
    AT, BT, ACC = a_trans, b_trans, accumulate

    @cuda.jit(device=True, inline=True)
    def load(src, trans, rows0, k0, e, n_rows, K, span):
        """Element ``e`` of a (span rows x BK) slice: (row, k, value); coalesced per layout."""
        if trans:
            r = e % span
            c = e // span
            v = float32(0.0)
            if rows0 + r < n_rows and k0 + c < K:
                v = src[k0 + c, rows0 + r]
        else:
            r = e // BK
            c = e % BK
            v = float32(0.0)
            if rows0 + r < n_rows and k0 + c < K:
                v = src[rows0 + r, k0 + c]
        return r, c, v

    @cuda.jit
    def gemm_tn(a, b, acc_in, y):
        M = y.shape[0]
        N = y.shape[1]
        K = a.shape[0] if AT else a.shape[1]
        As = cuda.shared.array((2, BK, BMP), float32)  # 2 x (bk, bm) slices of A, k-major
        Bs = cuda.shared.array((2, BK, BNP), float32)  # 2 x (bk, bn) slices of B, k-major
        acc = cuda.local.array((TM, TN), float32)  # (tm, tn)
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TN, float32)
        a_pf = cuda.local.array(A_LOADS, float32)
        b_pf = cuda.local.array(B_LOADS, float32)
        a_rc = cuda.local.array((A_LOADS, 2), np.int32)
        b_rc = cuda.local.array((B_LOADS, 2), np.int32)
        tid = cuda.threadIdx.x
        tx = tid % NTX
        ty = tid // NTX
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        n_steps = (K + BK - 1) // BK
        for l in range(A_LOADS):
            r, c, v = load(a, AT, m0, 0, tid + l * NT, M, K, BM)
            As[0, c, r] = v
            a_rc[l, 0] = r
            a_rc[l, 1] = c
        for l in range(B_LOADS):
            r, c, v = load(b, BT, n0, 0, tid + l * NT, N, K, BN)
            Bs[0, c, r] = v
            b_rc[l, 0] = r
            b_rc[l, 1] = c
        cuda.syncthreads()
        for s in range(n_steps):
            cur = s % 2
            k1 = (s + 1) * BK
            has_next = s + 1 < n_steps
            if has_next:
                for l in range(A_LOADS):
                    r, c, v = load(a, AT, m0, k1, tid + l * NT, M, K, BM)
                    a_pf[l] = v
                for l in range(B_LOADS):
                    r, c, v = load(b, BT, n0, k1, tid + l * NT, N, K, BN)
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
                nxt = 1 - cur  # last read in step s - 1, finished before the last barrier
                for l in range(A_LOADS):
                    As[nxt, a_rc[l, 1], a_rc[l, 0]] = a_pf[l]
                for l in range(B_LOADS):
                    Bs[nxt, b_rc[l, 1], b_rc[l, 0]] = b_pf[l]
            cuda.syncthreads()
        for i in range(TM):
            r = m0 + ty + i * NTY
            if r < M:
                for j in range(TN):
                    c = n0 + tx + j * NTX
                    if c < N:
                        if ACC:
                            y[r, c] = acc_in[r, c] + acc[i, j]
                        else:
                            y[r, c] = acc[i, j]

    return gemm_tn


def _tiles() -> GemmTiles:
    return SIM_TILES if simulating() else GPU_TILES


def _launch(a, b, acc, y, a_trans, b_trans, stream, tiles):
    tiles = tiles or _tiles()
    m, n = y.shape
    if m == 0 or n == 0:
        return
    kernel = make_gemm_tn(tiles, a_trans, b_trans, acc is not None)
    grid = (-(-n // tiles.bn), -(-m // tiles.bm))
    kernel[grid, tiles.threads, stream](a, b, y if acc is None else acc, y)


def _check(names, arrays, ndim=2):
    for name, a in zip(names, arrays):
        if a is not None:
            check_ndim(name, a, ndim)
            check_float32(name, a)


def linear_dx(dy, w, dx, stream=0, acc=None, tiles: GemmTiles | None = None):
    """Enqueue ``dx = dy @ w`` (+ ``acc``): dy (M, N), w (N, K), dx and acc (M, K)."""
    _check(("dy", "w", "dx", "acc"), (dy, w, dx, acc))
    m, n = dy.shape
    n2, k = w.shape
    if n2 != n or tuple(dx.shape) != (m, k) or (acc is not None and tuple(acc.shape) != (m, k)):
        raise ValueError(f"linear_dx: dy {tuple(dy.shape)} (M, N), w {tuple(w.shape)} (N, K), dx "
                         f"{tuple(dx.shape)} and acc {None if acc is None else tuple(acc.shape)} (M, K) disagree")
    _launch(dy, w, acc, dx, False, True, stream, tiles)


def linear_dw(dy, x, dw, stream=0, acc=None, tiles: GemmTiles | None = None):
    """Enqueue ``dw = dy.T @ x`` (+ ``acc``): dy (M, N), x (M, K), dw and acc (N, K)."""
    _check(("dy", "x", "dw", "acc"), (dy, x, dw, acc))
    m, n = dy.shape
    m2, k = x.shape
    if m2 != m or tuple(dw.shape) != (n, k) or (acc is not None and tuple(acc.shape) != (n, k)):
        raise ValueError(f"linear_dw: dy {tuple(dy.shape)} (M, N), x {tuple(x.shape)} (M, K), dw "
                         f"{tuple(dw.shape)} and acc {None if acc is None else tuple(acc.shape)} (N, K) disagree")
    _launch(dy, x, acc, dw, True, True, stream, tiles)


def validate(shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8)), tiles: GemmTiles | None = None,
             rtol: float = 1e-5, seed: int = 0) -> list[dict]:
    """Both launchers, with and without ``acc``, on each (M, N, K) against the references."""
    rng = np.random.default_rng(seed)
    records = []
    for m, n, k in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)  # (M, K)
        w = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        dy = rng.standard_normal((m, n), dtype=np.float32)  # (M, N)
        gx = rng.standard_normal((m, k), dtype=np.float32)  # (M, K) existing gradients
        gw = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        cases = (
            ("dx", linear_dx, (dy, w), None, reference.linear_backward_x(dy, w)),
            ("dx+acc", linear_dx, (dy, w), gx, gx + reference.linear_backward_x(dy, w)),
            ("dw", linear_dw, (dy, x), None, reference.linear_backward_w(dy, x)),
            ("dw+acc", linear_dw, (dy, x), gw, reference.linear_backward_w(dy, x, gw)),
        )
        for name, fn, ins, acc, want in cases:
            d_out = cuda.device_array(want.shape, dtype=np.float32)
            fn(*(cuda.to_device(a) for a in ins), d_out, acc=None if acc is None else cuda.to_device(acc),
               tiles=tiles)
            got = d_out.copy_to_host()
            err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
            records.append({"shape": (m, n, k), "case": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"linear {name} at (M,N,K)={(m, n, k)}: max rel err {err:.3g}")
    return records
