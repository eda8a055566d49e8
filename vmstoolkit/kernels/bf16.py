"""bf16 storage, fp32 arithmetic: the block's non-GEMM kernels for ``LlamaBlockConfig(dtype="bfloat16")``,
the mixed-precision AdamW step, and their numpy references, which round to bf16 at the same points.

bf16 arrays are uint16 arrays of bf16 bit patterns (as in :mod:`.gemm_bf16`; a torch bf16 tensor
``.view(torch.int16)`` is accepted by the launchers and read as uint16). Every kernel widens its
bf16 inputs to fp32 exactly (:func:`._mma.bf16_to_f32`), computes in fp32 and rounds to nearest
even once per operation that Hugging Face's bf16 ``LlamaDecoderLayer`` rounds (each torch bf16
op rounds its result):

============== ======================================================================================
kernel          what it computes (``rn``: round fp32 to bf16)
============== ======================================================================================
rmsnorm_bf16    ``y = rn(w * rn(x * inv))``, ``inv = 1 / sqrt(mean(x^2) + eps)`` summed in fp32
                (HF: ``weight * hidden.to(float32) * rsqrt(var + eps)).to(bf16)``)
rope_bf16       ``c, s = rn(cos), rn(sin)`` (HF casts its fp32 tables to bf16); ``y1 = rn(rn(x1 c) -
                rn(x2 s))``, ``y2 = rn(rn(x2 c) + rn(x1 s))`` (HF: ``q * cos + rotate_half(q) * sin``)
swiglu_bf16     ``y = rn(rn(silu(g)) * u)`` (HF: ``act_fn(gate_proj(x)) * up_proj(x)``)
residual_bf16   ``y = rn(a + b)``
widen / narrow  bf16 -> fp32 (exact) / fp32 -> bf16 (``rn``)
adamw_mixed     AdamW on fp32 master weights and moments from a bf16 or fp32 gradient; writes the
                fp32 master, moments and the bf16 copy ``rn(w')`` the next forward reads
============== ======================================================================================

Note [bf16 noise]
-----------------
How "equal to bf16 noise" is measured. ``err(a, b) = max |a - b| / max |b|``, the largest
deviation relative to the output's scale. A bf16 rounding has unit roundoff ``u = 2^-8`` (8
significant bits); one ulp of a value is ``2u`` of it at most.

- Against :func:`reference_block` (the same rounding points, exact sums): the kernels sum in fp32
  in another order, so their pre-rounding values are within ``~ n 2^-24`` relative (``n`` the
  reduction length) of the reference's and round differently only where a value lies that close to
  a rounding boundary: by one ulp, which travels on through the later ops with a gain of order
  one, and by many ulps of a small output where a residual add cancels. No fixed share of
  differing outputs is right for every shape, so the GPU test measures the share beside the same
  reference with cuBLAS's bf16 GEMMs (fp32 accumulation) in place of the exact sums: ours may
  differ at no more outputs than that cuBLAS-ordered reference, plus 2%, and ``err <= 4u``.
  Measured on the H200 (H 256, 4 heads, 2 KV heads, 2 x 37 tokens; kernels-h200/run10-bf16-rounding):
  ``err`` 0.00259; 6.40% of the outputs differ from the exact reference, exactly as many as for
  the cuBLAS-ordered one, and ours equals the cuBLAS-ordered reference at every output. The fp32
  computation of the same inputs differs at 64.8% of the outputs, so a missing rounding point
  fails the test (``tests/kernels/test_bf16_block.py``: bit-equal at the simulator's sizes).
- Against ``transformers`` (its eager path rounds the scores and probabilities to bf16, its SDPA
  path does not, so the two disagree by ``err`` 0.0074 with each other): with ``truth`` the layer
  in fp32 on the same bf16 weights and input, ours must satisfy ``err(ours, truth) <= 2
  err(hf_bf16, truth) + 2u`` for both paths, and ``err(ours, hf)`` is reported
  (``tests/gpu/test_block_bf16_gpu.py``). Measured on the CPU (torch 2.13, transformers 5.24; H 256,
  4 heads, 2 KV heads, T 37): ``reference_block`` is 0.0037 (about one ulp of the scale) from HF's
  eager and its SDPA layer, which are 0.0047 from ``truth``; with the probabilities rounded
  (``round_p=True``) it is bit-equal to HF's SDPA at 94% of the outputs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64, uint16

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._mma import bf16_to_f32, pack_bf16x2
from ._util import check_float32, check_ndim, check_shape, elementwise_grid, flat, simulating
from .adamw import step_scalars
from .mma_layout import bf16_bits, bf16_value
from .rmsnorm import THREADS_GPU, THREADS_SIM, make_block_sum

UNIT_ROUNDOFF = 2.0 ** -8  # bf16: 8 significant bits, round to nearest

BF16_DTYPES = (np.dtype(np.uint16), np.dtype(np.int16))


# ---- host helpers -------------------------------------------------------------------------------


def to_bits(a) -> np.ndarray:
    """float array -> bf16 bit patterns (uint16), round to nearest even."""
    return bf16_bits(np.asarray(a, np.float32))


def values(bits) -> np.ndarray:
    """bf16 bit patterns (uint16 or int16) -> their float32 values (exact)."""
    return bf16_value(np.asarray(bits).view(np.uint16) if np.asarray(bits).dtype == np.int16 else bits)


def rn(a) -> np.ndarray:
    """float -> float32 value of its bf16 rounding (the reference's rounding points)."""
    return values(to_bits(a))


def is_bf16(a) -> bool:
    return np.dtype(a.dtype) in BF16_DTYPES


def check_bf16(name: str, a) -> None:
    if not is_bf16(a):
        raise KernelError(f"{name} must hold bf16 bits as uint16 or int16, got dtype={np.dtype(a.dtype)} "
                          f"(shape={tuple(a.shape)})")


def as_u16(a):
    """An int16 (torch bf16 ``.view(torch.int16)``) array as uint16: same bits, no copy."""
    return a.view(np.uint16) if np.dtype(a.dtype) == np.int16 else a


# ---- device helpers -----------------------------------------------------------------------------


@cuda.jit(device=True)
def round_bits(v):
    """fp32 -> its bf16 bits (uint16), round to nearest even (``cvt.rn.bf16x2``)."""
    return uint16(pack_bf16x2(v, v) & 0xFFFF)


@cuda.jit(device=True)
def round_value(v):
    """fp32 -> the fp32 value of its bf16 rounding."""
    return bf16_to_f32(pack_bf16x2(v, v))


# ---- kernels --------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def make_rmsnorm_bf16_kernel(threads: int):
    block_sum = make_block_sum(threads)

    @fastlaunch.jit
    def rmsnorm_bf16_kernel(x, w, y, eps):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        h = x.shape[1]
        part = cuda.shared.array(threads, float32)  # (threads,) partial sums of squares
        s = float32(0.0)
        for c in range(tid, h, threads):
            v = bf16_to_f32(x[row, c])
            s += v * v
        inv = float32(1.0) / math.sqrt(block_sum(part, tid, s) / float32(h) + eps)
        for c in range(tid, h, threads):
            hn = round_value(bf16_to_f32(x[row, c]) * inv)
            y[row, c] = round_bits(bf16_to_f32(w[c]) * hn)

    return rmsnorm_bf16_kernel


def rmsnorm_bf16(x, w, y, eps: float = 1e-6, stream=0, threads: int | None = None):
    """Enqueue RMSNorm of the rows of x (R, H) bf16 with weight w (H,) bf16 into y (R, H) bf16."""
    for name, a in (("x", x), ("w", w), ("y", y)):
        check_bf16(name, a)
    check_ndim("x", x, 2)
    r, h = x.shape
    check_shape("rmsnorm weight", w, (h,))
    check_shape("rmsnorm output", y, (r, h))
    threads = threads or (THREADS_SIM if simulating() else THREADS_GPU)
    if r == 0:
        return
    make_rmsnorm_bf16_kernel(threads)[r, threads, stream](as_u16(x), as_u16(w), as_u16(y), np.float32(eps))


@fastlaunch.jit
def _rope_bf16_kernel(x, y, theta, offset):
    b_, t_, nh, hd = x.shape
    half = hd // 2
    n = b_ * t_ * nh * half
    for e in range(cuda.grid(1), n, cuda.gridsize(1)):
        i = e % half
        rest = e // half
        h = rest % nh
        rest //= nh
        t = rest % t_
        b = rest // t_
        inv_freq = 1.0 / (theta ** (float64(2 * i) / float64(hd)))
        ang = float64(t + offset) * inv_freq
        c = round_value(float32(math.cos(ang)))
        s = round_value(float32(math.sin(ang)))
        x1 = bf16_to_f32(x[b, t, h, i])
        x2 = bf16_to_f32(x[b, t, h, i + half])
        y[b, t, h, i] = round_bits(round_value(x1 * c) - round_value(x2 * s))
        y[b, t, h, i + half] = round_bits(round_value(x2 * c) + round_value(x1 * s))


def rope_bf16(x, y, theta: float = 10000.0, offset: int = 0, stream=0):
    """Enqueue RoPE of x (B, T, nh, hd) bf16 at positions offset..offset+T-1 into y (may be x)."""
    check_bf16("x", x)
    check_bf16("rope output", y)
    check_ndim("x", x, 4)
    if tuple(y.shape) != tuple(x.shape):
        raise KernelError(f"rope: output shape {tuple(y.shape)} != input shape {tuple(x.shape)}")
    b, t, nh, hd = x.shape
    if hd % 2:
        raise KernelError(f"rope: head_dim must be even, got {hd}")
    n = b * t * nh * (hd // 2)
    if n == 0:
        return
    blocks, threads = elementwise_grid(n)
    _rope_bf16_kernel[blocks, threads, stream](as_u16(x), as_u16(y), np.float64(theta), np.int64(offset))


@fastlaunch.jit
def _swiglu_bf16_kernel(gate, up, y):
    for e in range(cuda.grid(1), gate.shape[0], cuda.gridsize(1)):
        g = bf16_to_f32(gate[e])
        y[e] = round_bits(round_value(g / (float32(1.0) + math.exp(-g))) * bf16_to_f32(up[e]))


@fastlaunch.jit
def _residual_bf16_kernel(a, b, y):
    for e in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        y[e] = round_bits(bf16_to_f32(a[e]) + bf16_to_f32(b[e]))


@fastlaunch.jit
def _widen_kernel(x, y):
    for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        y[e] = bf16_to_f32(x[e])


@fastlaunch.jit
def _narrow_kernel(x, y):
    for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        y[e] = round_bits(x[e])


def _binary(op: str, kernel, a, b, y, stream) -> None:
    for name, arr in zip(("a", "b", f"{op} output"), (a, b, y)):
        check_bf16(f"{op}: {name}", arr)
    if tuple(a.shape) != tuple(b.shape) or tuple(y.shape) != tuple(a.shape):
        raise KernelError(f"{op}: shapes {tuple(a.shape)}, {tuple(b.shape)} and output {tuple(y.shape)} "
                          f"must be one")
    fa = flat(as_u16(a))
    if fa.shape[0] == 0:
        return
    blocks, threads = elementwise_grid(fa.shape[0])
    kernel[blocks, threads, stream](fa, flat(as_u16(b)), flat(as_u16(y)))


def swiglu_bf16(gate, up, y, stream=0):
    """Enqueue ``y = rn(rn(silu(gate)) * up)`` (bf16, contiguous, one shape; y may alias either)."""
    _binary("swiglu_bf16", _swiglu_bf16_kernel, gate, up, y, stream)


def residual_add_bf16(a, b, y, stream=0):
    """Enqueue ``y = rn(a + b)`` (bf16, contiguous, one shape; y may alias either)."""
    _binary("residual_add_bf16", _residual_bf16_kernel, a, b, y, stream)


def _convert(op: str, kernel, x, y, stream) -> None:
    if tuple(x.shape) != tuple(y.shape):
        raise KernelError(f"{op}: input {tuple(x.shape)} and output {tuple(y.shape)} must have one shape")
    fx = flat(x)
    if fx.shape[0] == 0:
        return
    blocks, threads = elementwise_grid(fx.shape[0])
    kernel[blocks, threads, stream](fx, flat(y))


def widen(x, y, stream=0):
    """Enqueue ``y = float32(x)``: x bf16, y float32 (contiguous, one shape), exact."""
    check_bf16("widen input", x)
    check_float32("widen output", y)
    _convert("widen", _widen_kernel, as_u16(x), y, stream)


def narrow(x, y, stream=0):
    """Enqueue ``y = rn(x)``: x float32, y bf16 (contiguous, one shape)."""
    check_float32("narrow input", x)
    check_bf16("narrow output", y)
    _convert("narrow", _narrow_kernel, x, as_u16(y), stream)


@cuda.jit(device=True)
def _grad_bf16(g, e):
    return bf16_to_f32(g[e])


@cuda.jit(device=True)
def _grad_f32(g, e):
    return g[e]


@lru_cache(maxsize=None)
def _make_adamw_mixed(bf16_grad: bool):
    load = _grad_bf16 if bf16_grad else _grad_f32

    @fastlaunch.jit
    def adamw_mixed_kernel(w, g, m, v, w_out, m_out, v_out, w_bf16, step_size, inv_bc2_sqrt, beta1, beta2,
                           eps, decay):
        for e in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
            gi = load(g, e)
            mi = beta1 * m[e] + (float32(1.0) - beta1) * gi
            vi = beta2 * v[e] + (float32(1.0) - beta2) * gi * gi
            wi = w[e] * decay - step_size * mi / (math.sqrt(vi) * inv_bc2_sqrt + eps)
            w_out[e] = wi
            m_out[e] = mi
            v_out[e] = vi
            w_bf16[e] = round_bits(wi)

    return adamw_mixed_kernel


def adamw_mixed(w, g, m, v, w_out, m_out, v_out, w_bf16, *, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, step: int = 1,
                stream=0) -> None:
    """Enqueue one AdamW step (``torch.optim.AdamW``, as :func:`.adamw.adamw`) on fp32 master
    weights ``w`` and moments ``m``, ``v`` from the gradient ``g`` (bf16 bits or float32), writing
    the fp32 ``w_out``, ``m_out``, ``v_out`` (may alias the inputs) and ``w_bf16 = rn(w_out)``."""
    arrays = {"w": w, "m": m, "v": v, "w_out": w_out, "m_out": m_out, "v_out": v_out}
    for name, a in arrays.items():
        check_float32(f"adamw_mixed: {name}", a)
    if not is_bf16(g):
        check_float32("adamw_mixed: g (bf16 bits or float32)", g)
    check_bf16("adamw_mixed: w_bf16", w_bf16)
    scalars = step_scalars("adamw_mixed", {**arrays, "g": g, "w_bf16": w_bf16}, lr, beta1, beta2, eps,
                           weight_decay, step)
    n = int(np.prod(w.shape))
    if n == 0:
        return
    blocks, threads = elementwise_grid(n)
    _make_adamw_mixed(is_bf16(g))[blocks, threads, stream](
        flat(w), flat(as_u16(g) if is_bf16(g) else g), flat(m), flat(v), flat(w_out), flat(m_out), flat(v_out),
        flat(as_u16(w_bf16)), *scalars)


# ---- numpy references (float32 values of bf16 data, rounded where the kernels round) ---------------


def reference_rmsnorm(x, w, eps: float = 1e-6) -> np.ndarray:
    """x (..., H), w (H,) bf16 values (float32) -> the float32 values of :func:`rmsnorm_bf16`'s output."""
    x64 = np.asarray(x, np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return rn(np.asarray(w, np.float32) * rn(x64 * inv))


def reference_rope(x, theta: float = 10000.0, offset: int = 0) -> np.ndarray:
    """x (B, T, nh, hd) bf16 values -> :func:`rope_bf16`'s output values."""
    _, t, _, hd = x.shape
    cos, sin = (rn(a)[None, :, None, :] for a in reference.rope_cos_sin(t, hd, theta, offset))  # (1, T, 1, hd)
    half = hd // 2
    x = np.asarray(x, np.float32)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return rn(rn(x * cos) + rn(rotated * sin))


def reference_swiglu(gate, up) -> np.ndarray:
    g = np.asarray(gate, np.float32)
    return rn(rn(g / (np.float32(1.0) + np.exp(-g))) * np.asarray(up, np.float32))


def reference_attention(q, k, v, round_p: bool = False) -> np.ndarray:
    """Causal GQA attention of bf16 values in float64, softmax exact, output rounded to bf16;
    with ``round_p`` the probabilities are rounded to bf16 before ``P V`` (as a flash kernel
    feeding P to a bf16 mma does; the running max and sum stay fp32)."""
    if not round_p:
        return rn(reference.attention(*(np.asarray(a, np.float64) for a in (q, k, v))))
    b, t, nh, hd = q.shape
    group = nh // k.shape[2]
    qh = np.asarray(q, np.float64).transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    kh = np.repeat(np.asarray(k, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(np.asarray(v, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    s = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(hd)  # (B, nh, T, T)
    s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))  # unnormalised, <= 1
    out = (rn(p) @ vh) / p.sum(-1, keepdims=True)
    return rn(out.transpose(0, 2, 1, 3))


def reference_block(x, weights: dict, n_heads: int, n_kv_heads: int, eps: float = 1e-6,
                    theta: float = 10000.0, round_p: bool = False, matmul=None) -> np.ndarray:
    """The bf16 ``LlamaDecoderLayer`` on bf16 values: ``x`` (B, T, H) and ``weights`` (a state
    dict) hold float32 values of bf16 numbers (``values(bits)``); every GEMM sums exactly and
    rounds once, every other op rounds where its kernel does. Returns (B, T, H) float32 values.

    ``matmul(a, w)``, if given, computes each GEMM's unrounded ``a @ w.T`` in place of the exact
    sum (``a`` (M, K) and ``w`` (N, K) float64 arrays of bf16 values; any float array back): the
    same rounding points with another summation, for instance a vendor GEMM's, to measure how
    far an order change alone moves the outputs."""
    b, t, h = x.shape
    hd = h // n_heads
    w = {k: np.asarray(a, np.float64) for k, a in weights.items()}

    def linear(a, name):  # the exact product (or ``matmul``'s), one rounding
        a = np.asarray(a, np.float64)
        return rn(a @ w[name].T if matmul is None else np.asarray(matmul(a, w[name]), np.float64))

    x2d = np.asarray(x, np.float32).reshape(b * t, h)  # (M, H)
    hn = reference_rmsnorm(x2d, w["input_layernorm.weight"], eps)  # (M, H)
    q = linear(hn, "self_attn.q_proj.weight").reshape(b, t, n_heads, hd)  # (B, T, nh, hd)
    k = linear(hn, "self_attn.k_proj.weight").reshape(b, t, n_kv_heads, hd)  # (B, T, nkv, hd)
    v = linear(hn, "self_attn.v_proj.weight").reshape(b, t, n_kv_heads, hd)  # (B, T, nkv, hd)
    a = reference_attention(reference_rope(q, theta), reference_rope(k, theta), v, round_p)
    x2 = rn(x2d + linear(a.reshape(b * t, n_heads * hd), "self_attn.o_proj.weight"))  # (M, H)
    hn = reference_rmsnorm(x2, w["post_attention_layernorm.weight"], eps)  # (M, H)
    s = reference_swiglu(linear(hn, "mlp.gate_proj.weight"), linear(hn, "mlp.up_proj.weight"))  # (M, F)
    out = rn(x2 + linear(s, "mlp.down_proj.weight"))  # (M, H)
    return out.reshape(b, t, h)
