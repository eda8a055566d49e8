"""The per-lane data flow of a bf16 flash-attention forward on ``mma.sync`` m16n8k16, in numpy: the
CPU model that the Numba kernel (:mod:`.flash_bf16`) follows lane for lane: its executable spec.

One warp owns 16 query rows of one head; it walks the causal key tiles of 16 keys:

1. ``S = Q K^T`` (16 x 16) as two n8 accumulator tiles: the Q fragments (A, ``D / 16`` k steps)
   stay in registers for the whole walk, K's come as B ("col": a key's head-dim elements are
   contiguous in memory, so ``ldmatrix`` without ``.trans``);
2. online softmax in fp32, base 2 (``log2(e) / sqrt(D)`` is the one scale, each exponential an
   ``exp2``, as the kernel's ``ex2.approx``): lane ``l`` owns rows ``g = l >> 2`` and ``g + 8`` (registers 0, 1 and
   2, 3 of each S tile, :func:`.mma_layout.c_coords`); a row's max is the max over the lane's 4
   values of it, then over the 4 lanes of its quad (two ``shfl.xor`` 1, 2: :func:`quad_max`);
   the running sum stays a per-lane partial sum until the end (the rescale factor is the same
   across the quad), so the walk needs no other shuffle;
3. ``O += P V``: P's accumulator registers *are* the A fragment of a 16 x 16 operand once packed
   to bf16 (:func:`scores_to_a`: S tile 0's registers (0, 1), (2, 3) become A registers 0, 1,
   tile 1's become 2, 3), so P never touches shared memory; V comes as B with ``.trans``
   (keys down the rows in memory);
4. the end: the quad's partial sums added, O times their reciprocal, written by ``c_coords``;
   the row's log-sum-exp (natural log, of the scaled scores) is ``m ln 2 + ln l``.

Every fp32 operation is the kernel's (:mod:`.flash_bf16`), in its order (the running sum adds the
lane's 4 values of a row one by one), so that under the simulator, whose intrinsic twins compute
with this module's :mod:`.mma_layout`, the kernel with 16-key tiles equals :func:`forward` bit
for bit (``tests/kernels/test_flash_bf16.py``).

Rounding: P is rounded to bf16 for the mma (the running max and sum use the fp32 values), the
output once to bf16: :func:`.bf16.reference_attention` with ``round_p=True`` rounds the same way.

Cost: O(T^2 D / 256) calls of :func:`.mma_layout.mma`, each O(32 x 16 x 16) numpy: tests only.
"""

from __future__ import annotations

import math

import numpy as np

from . import mma_layout as L

ROWS = 16  # query rows per warp (mma's m)
KEYS = 16  # keys per tile: two n8 tiles of S, one k16 step of P V
LOG2E = np.float64(1.4426950408889634)
LN2 = 0.6931471805599453


def scores_to_a(s0: np.ndarray, s1: np.ndarray) -> np.ndarray:
    """Two (32, 4) fp32 accumulator tiles (columns 0-7 and 8-15 of a 16 x 16 matrix) -> the
    (32, 4) uint32 A registers of that matrix in bf16, with no data exchanged between lanes."""
    b0, b1 = L.bf16_bits(s0), L.bf16_bits(s1)  # (32, 4) each
    return np.stack([L.pack(b0[:, 0], b0[:, 1]), L.pack(b0[:, 2], b0[:, 3]),
                     L.pack(b1[:, 0], b1[:, 1]), L.pack(b1[:, 2], b1[:, 3])], axis=1)


def quad_max(v: np.ndarray) -> np.ndarray:
    """(32,) per-lane values -> each lane's max over its quad (lanes 4g .. 4g+3): ``shfl.xor`` 1 then 2."""
    lanes = np.arange(L.WARP)
    v = np.maximum(v, v[lanes ^ 1])
    return np.maximum(v, v[lanes ^ 2])


def quad_sum(v: np.ndarray) -> np.ndarray:
    lanes = np.arange(L.WARP)
    v = v + v[lanes ^ 1]
    return v + v[lanes ^ 2]


def _tile(a: np.ndarray, r0: int, c0: int, rows: int, cols: int) -> np.ndarray:
    """a[r0:r0+rows, c0:c0+cols] with zeros outside ``a`` (the kernel's zero-filled loads)."""
    out = np.zeros((rows, cols), a.dtype)
    part = a[r0:r0 + rows, c0:c0 + cols]
    out[:part.shape[0], :part.shape[1]] = part
    return out


def warp_forward(q_bits: np.ndarray, k_bits: np.ndarray, v_bits: np.ndarray, r0: int, with_lse: bool = False):
    """One warp: rows ``r0 .. r0+15`` of causal attention of one head. ``q_bits`` (T, D), ``k_bits``
    and ``v_bits`` (T, D) bf16 bits of that head and its key/value head, D a multiple of 16.
    Returns (16, D) float32 (rows past T are zero), before the output's bf16 rounding; with
    ``with_lse`` also the rows' (16,) log-sum-exps."""
    t, d = q_bits.shape
    ksteps, ntiles = d // 16, d // 8
    qa = [L.a_fragments(_tile(q_bits, r0, 16 * kd, ROWS, 16)) for kd in range(ksteps)]
    rows_c, cols_c = (np.array([L.c_coords(lane) for lane in range(L.WARP)])[..., i] for i in range(2))  # (32, 4)
    o = [np.zeros((L.WARP, 4), np.float32) for _ in range(ntiles)]
    m = np.full((L.WARP, 2), -np.inf, np.float32)  # running max of rows g, g + 8
    lsum = np.zeros((L.WARP, 2), np.float32)  # per-lane partial sums of rows g, g + 8
    scale = np.float32(LOG2E / math.sqrt(d))
    last = min(t - 1, r0 + ROWS - 1)  # the last key any of the warp's rows sees
    for j0 in range(0, last + 1, KEYS):
        s = []
        for n in range(2):  # S columns 8n .. 8n+7
            acc = np.zeros((L.WARP, 4), np.float32)
            for kd in range(ksteps):
                kb = _tile(k_bits, j0 + 8 * n, 16 * kd, 8, 16).T  # (16 d, 8 keys)
                acc = L.mma(qa[kd], L.b_fragments(np.ascontiguousarray(kb)), acc)
            key = j0 + 8 * n + cols_c
            dead = (key > r0 + rows_c) | (key >= t)
            s.append(np.where(dead, -np.inf, acc * scale).astype(np.float32))
        # registers 0, 1 of both tiles are row g; 2, 3 row g + 8
        tile_max = np.stack([np.max(np.concatenate([s[0][:, :2], s[1][:, :2]], 1), 1),
                             np.max(np.concatenate([s[0][:, 2:], s[1][:, 2:]], 1), 1)], 1)  # (32, 2)
        m_new = np.maximum(m, np.stack([quad_max(tile_max[:, 0]), quad_max(tile_max[:, 1])], 1))  # (32, 2)
        safe = np.where(np.isinf(m_new), np.float32(0.0), m_new)  # a row with no live key yet
        alpha = np.exp2(m - safe).astype(np.float32)  # (32, 2); exp2(-inf) = 0 at the first tile
        row_of = np.array([0, 0, 1, 1])  # register -> which of the lane's two rows
        p = [np.exp2(si - safe[:, row_of]).astype(np.float32) for si in s]
        lsum = lsum * alpha  # then the lane's values of each row, one by one (the kernel's order)
        for si in p:
            for r in range(4):
                lsum[:, r >> 1] += si[:, r]
        m = m_new
        pa = scores_to_a(p[0], p[1])
        for nd in range(ntiles):  # O columns 8nd .. 8nd+7
            vb = _tile(v_bits, j0, 8 * nd, 16, 8)  # (16 keys, 8 d)
            o[nd] = L.mma(pa, L.b_fragments(vb), o[nd] * alpha[:, row_of])
    total = np.stack([quad_sum(lsum[:, 0]), quad_sum(lsum[:, 1])], 1)  # (32, 2)
    with np.errstate(divide="ignore"):
        inv = np.where(total > 0, np.float32(1.0) / total, np.float32(0.0)).astype(np.float32)  # (32, 2)
    out = np.zeros((ROWS, d), np.float32)
    for nd in range(ntiles):
        out[:, 8 * nd:8 * nd + 8] = L.c_matrix(o[nd] * inv[:, row_of])
    out[max(0, t - r0):] = 0.0
    if not with_lse:
        return out
    with np.errstate(divide="ignore"):
        lse_lane = m * np.float32(LN2) + np.log(total)  # (32, 2): rows g, g + 8 of each lane
    lse = np.zeros(ROWS, np.float32)
    lse[np.arange(L.WARP) >> 2] = lse_lane[:, 0]
    lse[(np.arange(L.WARP) >> 2) + 8] = lse_lane[:, 1]
    lse[max(0, t - r0):] = 0.0
    return out, lse


def forward(q_bits: np.ndarray, k_bits: np.ndarray, v_bits: np.ndarray, with_lse: bool = False):
    """Causal GQA attention of q (B, T, nh, D), k, v (B, T, nkv, D) bf16 bits by :func:`warp_forward`
    per (batch, head, 16-row tile); returns the (B, T, nh, D) float32 output values rounded to bf16
    (and with ``with_lse`` the (B, nh, T) float32 log-sum-exps)."""
    b, t, nh, d = q_bits.shape
    group = nh // k_bits.shape[2]
    out = np.zeros((b, t, nh, d), np.float32)
    lse = np.zeros((b, nh, t), np.float32)
    for bi in range(b):
        for h in range(nh):
            for r0 in range(0, t, ROWS):
                rows, row_lse = warp_forward(q_bits[bi, :, h], k_bits[bi, :, h // group], v_bits[bi, :, h // group],
                                             r0, with_lse=True)
                out[bi, r0:r0 + ROWS, h] = rows[:t - r0]
                lse[bi, h, r0:r0 + ROWS] = row_lse[:t - r0]
    out = L.bf16_value(L.bf16_bits(out))
    return (out, lse) if with_lse else out
