"""Kernels that turn a stack of decoder blocks into a whole causal language model: the token
embedding, projection biases (Qwen2), taking rows, growing a KV cache by whole rows, attention of
new queries over a cache, and the greedy argmax.

Recipe as elsewhere in this package: a numpy reference, the kernel, a launcher. All are float32
except token ids (int32). Each is a plain grid-stride loop except two:

- ``attention_cached``: one block per (batch, query row, head); the block walks the keys in
  chunks of its width with an online softmax (running max and sum), each thread owning the
  output features ``d = tid, tid + width, ...`` (head_dim up to :data:`MAX_HEAD_DIM`). Query row
  ``i`` of ``Tq`` sits at position ``Tk - Tq + i`` and sees keys ``0 .. Tk - Tq + i`` (causal over
  a cache). Made for decoding (Tq = 1: one token at a time, bandwidth bound on the cache); the
  prefill uses :mod:`.attention`.
- ``argmax``: one block per row, a strided scan then a tree reduction in shared memory; ties go
  to the lowest index, as ``torch.argmax``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch
from ._util import check_float32, elementwise_grid, flat, simulating

MAX_HEAD_DIM = 256
_WIDTH_GPU, _WIDTH_SIM = 128, 32  # threads per block of attention_cached and argmax


# ---- references ---------------------------------------------------------------------------


def embedding_ref(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Rows ``table[ids]``: ids (T,) integers, table (V, H); returns (T, H)."""
    return table[np.asarray(ids).astype(np.int64)]


def bias_add_ref(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x + b`` over the rows of x (M, N), b (N,)."""
    return (x + b).astype(x.dtype, copy=False)


def take_rows_ref(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo .. hi-1`` of x (M, N)."""
    return np.array(x[lo:hi])


def append_rows_ref(cache: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``cache`` (T, N) with the rows of ``new`` (R, N) after it: (T + R, N)."""
    return np.concatenate([cache, new], axis=0)


def attention_cached_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA attention of ``q`` (B, Tq, nh, hd) over ``k``, ``v`` (B, Tk, nkv, hd), Tq <= Tk:
    query row i is at position Tk - Tq + i. Tq == Tk is ``reference.attention``."""
    b, tq, nh, hd = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    group = nh // nkv
    qh = q.transpose(0, 2, 1, 3)
    kh = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    s = (qh @ kh.transpose(0, 1, 3, 2)) / q.dtype.type(np.sqrt(hd))  # (B, nh, Tq, Tk)
    mask = np.arange(tk)[None, :] > (tk - tq + np.arange(tq))[:, None]
    s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).astype(q.dtype, copy=False)


def argmax_ref(x: np.ndarray) -> np.ndarray:
    """Index of the largest entry of each row of x (R, V) (the first on ties), int32."""
    return np.argmax(x, axis=-1).astype(np.int32)


# ---- kernels ------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _kernels():
    @fastlaunch.jit
    def embedding_kernel(ids, table, y):  # y (T*H,), table (V, H)
        h = table.shape[1]
        for e in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
            y[e] = table[ids[e // h], e % h]

    @fastlaunch.jit
    def bias_add_kernel(x, b, y):  # x, y flat (M*N,), b (N,)
        n = b.shape[0]
        for e in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
            y[e] = x[e] + b[e % n]

    @fastlaunch.jit
    def copy_from_kernel(x, start, y):  # y[e] = x[start + e]
        for e in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
            y[e] = x[start + e]

    @fastlaunch.jit
    def append_kernel(cache, new, y):  # y = cache ++ new, flat
        n = cache.shape[0]
        for e in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
            y[e] = cache[e] if e < n else new[e - n]

    @fastlaunch.jit
    def argmax_kernel(x, out):  # one block per row
        vals = cuda.shared.array(_WIDTH_GPU, float32)
        idxs = cuda.shared.array(_WIDTH_GPU, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        width = cuda.blockDim.x
        best = -math.inf
        at = int32(2147483647)
        for j in range(tid, x.shape[1], width):
            a = x[r, j]
            if a > best:
                best = a
                at = j
        vals[tid] = best
        idxs[tid] = at
        cuda.syncthreads()
        s = width // 2
        while s > 0:
            if tid < s:
                a, ia = vals[tid + s], idxs[tid + s]
                if a > vals[tid] or (a == vals[tid] and ia < idxs[tid]):
                    vals[tid] = a
                    idxs[tid] = ia
            cuda.syncthreads()
            s //= 2
        if tid == 0:
            out[r] = idxs[0]

    @fastlaunch.jit
    def attention_cached_kernel(q, k, v, o):
        sh_p = cuda.shared.array(_WIDTH_GPU, float32)
        acc = cuda.shared.array(MAX_HEAD_DIM, float32)
        b_, tq, nh, hd = q.shape
        tk, nkv = k.shape[1], k.shape[2]
        group = nh // nkv
        blk = cuda.blockIdx.x
        h = blk % nh
        rest = blk // nh
        i = rest % tq
        b = rest // tq
        kvh = h // group
        tid = cuda.threadIdx.x
        width = cuda.blockDim.x
        nkeys = tk - tq + i + 1
        scale = float32(1.0) / math.sqrt(float32(hd))
        for d in range(tid, hd, width):
            acc[d] = 0.0
        m = -math.inf
        ell = float32(0.0)
        for c0 in range(0, nkeys, width):
            j = c0 + tid
            s = -math.inf
            if j < nkeys:
                dot = float32(0.0)
                for d in range(hd):
                    dot += q[b, i, h, d] * k[b, j, kvh, d]
                s = dot * scale
            sh_p[tid] = s
            cuda.syncthreads()
            cmax = -math.inf
            for t in range(width):
                cmax = max(cmax, sh_p[t])
            m_new = max(m, cmax)
            alpha = math.exp(m - m_new)
            cuda.syncthreads()
            sh_p[tid] = math.exp(s - m_new) if j < nkeys else 0.0
            cuda.syncthreads()
            psum = float32(0.0)
            for t in range(width):
                psum += sh_p[t]
            ell = ell * alpha + psum
            n = min(width, nkeys - c0)
            for d in range(tid, hd, width):
                a = acc[d] * alpha
                for t in range(n):
                    a += sh_p[t] * v[b, c0 + t, kvh, d]
                acc[d] = a
            m = m_new
            cuda.syncthreads()
        for d in range(tid, hd, width):
            o[b, i, h, d] = acc[d] / ell

    return {"embedding": embedding_kernel, "bias_add": bias_add_kernel, "copy_from": copy_from_kernel,
            "append": append_kernel, "argmax": argmax_kernel, "attention_cached": attention_cached_kernel}


def _width() -> int:
    return _WIDTH_SIM if simulating() else _WIDTH_GPU


def _grid(n: int):
    return elementwise_grid(max(n, 1))


def embedding(ids, table, y, stream=0) -> None:
    check_float32("embedding table", table)
    check_float32("embedding output", y)
    if np.dtype(ids.dtype) != np.int32:
        raise KernelError(f"embedding ids must be int32, got dtype={np.dtype(ids.dtype)}")
    if tuple(y.shape) != (ids.shape[0], table.shape[1]):
        raise KernelError(f"embedding: output {tuple(y.shape)} != ({ids.shape[0]}, {table.shape[1]})")
    fy = flat(y)
    blocks, threads = _grid(fy.shape[0])
    _kernels()["embedding"][blocks, threads, stream](ids, table, fy)


def bias_add(x, b, y, stream=0) -> None:
    for name, a in (("x", x), ("bias", b), ("bias_add output", y)):
        check_float32(name, a)
    if len(x.shape) != 2 or tuple(b.shape) != (x.shape[1],) or tuple(y.shape) != tuple(x.shape):
        raise KernelError(f"bias_add: x {tuple(x.shape)}, bias {tuple(b.shape)}, output {tuple(y.shape)}")
    fy = flat(y)
    blocks, threads = _grid(fy.shape[0])
    _kernels()["bias_add"][blocks, threads, stream](flat(x), b, fy)


def take_rows(x, y, lo: int, stream=0) -> None:
    if len(x.shape) != 2 or y.shape[1] != x.shape[1] or not 0 <= lo <= x.shape[0] - y.shape[0]:
        raise KernelError(f"take_rows: rows {lo}.. of {tuple(x.shape)} into {tuple(y.shape)}")
    fy = flat(y)
    blocks, threads = _grid(fy.shape[0])
    _kernels()["copy_from"][blocks, threads, stream](flat(x), lo * x.shape[1], fy)


def append_rows(cache, new, y, stream=0) -> None:
    if cache.shape[1] != new.shape[1] or tuple(y.shape) != (cache.shape[0] + new.shape[0], cache.shape[1]):
        raise KernelError(f"append_rows: {tuple(cache.shape)} ++ {tuple(new.shape)} into {tuple(y.shape)}")
    fy = flat(y)
    blocks, threads = _grid(fy.shape[0])
    _kernels()["append"][blocks, threads, stream](flat(cache), flat(new), fy)


def argmax(x, out, stream=0) -> None:
    check_float32("argmax input", x)
    if len(x.shape) != 2 or tuple(out.shape) != (x.shape[0],) or np.dtype(out.dtype) != np.int32:
        raise KernelError(f"argmax: input {tuple(x.shape)} into int32 {tuple(out.shape)}")
    _kernels()["argmax"][x.shape[0], _width(), stream](x, out)


def attention_cached(q, k, v, o, stream=0) -> None:
    for name, a in (("q", q), ("k", k), ("v", v), ("attention output", o)):
        check_float32(name, a)
    b, tq, nh, hd = q.shape
    if (len(k.shape) != 4 or tuple(k.shape) != tuple(v.shape) or k.shape[0] != b or k.shape[3] != hd
            or k.shape[1] < tq or nh % k.shape[2] or tuple(o.shape) != tuple(q.shape)):
        raise KernelError(f"attention_cached: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                          f"output {tuple(o.shape)}")
    if hd > MAX_HEAD_DIM:
        raise KernelError(f"attention_cached: head_dim {hd} > {MAX_HEAD_DIM}")
    _kernels()["attention_cached"][b * tq * nh, _width(), stream](q, k, v, o)
