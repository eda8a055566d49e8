"""Softmax cross-entropy of a causal LM's logits, and its gradient, in one kernel.

``cross_entropy(logits, labels) -> (row_loss, dlogits)``, for logits (M, V) float32 and labels
(M,) int32 where a negative label is ignored (transformers' ``-100``; the training graph puts
the next token's id on every row and ``-1`` on each sequence's last row). With ``n`` the number
of rows whose label is not ignored:

- ``row_loss[r] = (logsumexp(logits[r]) - logits[r, labels[r]]) / n`` (0 on ignored rows), so
  the mean loss transformers reports (``LlamaForCausalLM(..., labels=ids).loss``) is
  ``row_loss.sum()``: summed on the host after the run, in float64, so that no atomic and no
  second kernel is needed, and the sum is the same in every run;
- ``dlogits[r] = (softmax(logits[r]) - onehot(labels[r])) / n`` (0 on ignored rows): the
  gradient of that mean.

No row is ignored twice over and none is counted when every label is ignored (then both
outputs are zero where transformers would give nan).

Recipe as elsewhere in this package: the numpy reference, the kernel (one block per row: the
block counts the valid labels, then a strided max, sum of exponentials and write of the
gradient row, with tree reductions in shared memory), the launcher.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch
from ._util import check_float32, simulating

_WIDTH_GPU, _WIDTH_SIM = 256, 32  # threads per block (a power of two: the reductions halve it)


def cross_entropy_ref(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row_loss (M,), dlogits (M, V)) in the dtype of ``logits`` (module docstring), computed
    in float64."""
    x = np.asarray(logits, np.float64)  # (M, V)
    lab = np.asarray(labels).astype(np.int64)  # (M,)
    valid = lab >= 0
    n = int(valid.sum())
    mx = x.max(axis=1, keepdims=True)
    e = np.exp(x - mx)
    tot = e.sum(axis=1, keepdims=True)
    rows = np.arange(x.shape[0])
    safe = np.where(valid, lab, 0)
    scale = (1.0 / n) if n else 0.0
    loss = np.where(valid, (np.log(tot[:, 0]) + mx[:, 0] - x[rows, safe]) * scale, 0.0)
    d = e / tot
    d[rows, safe] -= 1.0
    d *= np.where(valid, scale, 0.0)[:, None]
    return loss.astype(logits.dtype), d.astype(logits.dtype)


@lru_cache(maxsize=None)
def _kernel():
    @fastlaunch.jit
    def cross_entropy_kernel(x, labels, loss, dx):  # one block per row of x (M, V)
        shf = cuda.shared.array(_WIDTH_GPU, float32)
        shi = cuda.shared.array(_WIDTH_GPU, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        width = cuda.blockDim.x
        v = x.shape[1]
        c = int32(0)
        for j in range(tid, labels.shape[0], width):
            if labels[j] >= 0:
                c += 1
        shi[tid] = c
        m = -math.inf
        for j in range(tid, v, width):
            m = max(m, x[r, j])
        shf[tid] = m
        cuda.syncthreads()
        s = width // 2
        while s > 0:
            if tid < s:
                shi[tid] += shi[tid + s]
                shf[tid] = max(shf[tid], shf[tid + s])
            cuda.syncthreads()
            s //= 2
        n = shi[0]
        mx = shf[0]
        cuda.syncthreads()
        acc = float32(0.0)
        for j in range(tid, v, width):
            acc += math.exp(x[r, j] - mx)
        shf[tid] = acc
        cuda.syncthreads()
        s = width // 2
        while s > 0:
            if tid < s:
                shf[tid] += shf[tid + s]
            cuda.syncthreads()
            s //= 2
        tot = shf[0]
        lab = labels[r]
        if lab < 0 or n == 0:
            for j in range(tid, v, width):
                dx[r, j] = 0.0
            if tid == 0:
                loss[r] = 0.0
            return
        inv = float32(1.0) / float32(n)
        rtot = float32(1.0) / tot
        for j in range(tid, v, width):
            p = math.exp(x[r, j] - mx) * rtot
            if j == lab:
                p -= float32(1.0)
            dx[r, j] = p * inv
        if tid == 0:
            loss[r] = (math.log(tot) + mx - x[r, lab]) * inv

    return cross_entropy_kernel


def cross_entropy(logits, labels, loss, dlogits, stream=0) -> None:
    """Launch: ``loss`` (M,) and ``dlogits`` (M, V) from ``logits`` (M, V), ``labels`` (M,) int32."""
    check_float32("cross_entropy logits", logits)
    check_float32("cross_entropy loss", loss)
    check_float32("cross_entropy dlogits", dlogits)
    if np.dtype(labels.dtype) != np.int32:
        raise KernelError(f"cross_entropy labels must be int32, got dtype={np.dtype(labels.dtype)}")
    if (len(logits.shape) != 2 or tuple(labels.shape) != (logits.shape[0],) or tuple(loss.shape) != (logits.shape[0],)
            or tuple(dlogits.shape) != tuple(logits.shape)):
        raise KernelError(f"cross_entropy: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, loss "
                          f"{tuple(loss.shape)}, dlogits {tuple(dlogits.shape)}")
    width = _WIDTH_SIM if simulating() else _WIDTH_GPU
    _kernel()[logits.shape[0], width, stream](logits, labels, loss, dlogits)
