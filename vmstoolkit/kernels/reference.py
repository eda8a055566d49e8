"""Numpy references for the LLaMA decoder block operations.

These are the ground truth that every Numba kernel is validated against, and the kernels that
the runtime's simulated backend executes. Conventions follow Hugging Face ``transformers``:
linear weights are ``(out_features, in_features)``, RoPE uses ``rotate_half`` on the two halves
of each head, attention is causal with grouped-query heads (``n_heads % n_kv_heads == 0``).

All functions are pure: they never write into their inputs.
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import KernelError


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``y = x @ w.T`` for ``x`` of shape (M, K) and ``w`` of shape (N, K); returns (M, N)."""
    return x @ w.T


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * w`` (float32, or float64 for
    float64 input: the gradient checks difference it)."""
    xf = x.astype(np.result_type(x.dtype, np.float32), copy=False)
    var = np.mean(xf * xf, axis=-1, keepdims=True)
    return (xf / np.sqrt(var + xf.dtype.type(eps))) * w


def rope_cos_sin(seq: int, head_dim: int, theta: float = 10000.0, offset: int = 0):
    """The (seq, head_dim) cosine and sine tables of rotary embeddings, HF layout."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    pos = np.arange(offset, offset + seq, dtype=np.float64)
    freqs = np.outer(pos, inv_freq)  # (T, hd/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, hd)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope(x: np.ndarray, theta: float = 10000.0, offset: int = 0) -> np.ndarray:
    """Rotary position embedding of ``x`` laid out (B, T, n_heads, head_dim), positions
    ``offset .. offset+T-1``; returns the same shape."""
    _, t, _, hd = x.shape
    cos, sin = rope_cos_sin(t, hd, theta, offset)
    cos = cos[None, :, None, :]  # (1, T, 1, hd)
    sin = sin[None, :, None, :]
    half = hd // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype, copy=False)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return attention_lse(q, k, v)[0]


def attention_lse(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal scaled-dot-product attention.

    ``q`` is (B, T, n_heads, head_dim), ``k`` and ``v`` are (B, T, n_kv_heads, head_dim);
    returns (B, T, n_heads, head_dim). Query head ``h`` reads key/value head
    ``h // (n_heads // n_kv_heads)``.
    """
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    kk = np.repeat(k, group, axis=2)  # (B, T, nh, hd)
    vv = np.repeat(v, group, axis=2)
    qh = q.transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    kh = kk.transpose(0, 2, 1, 3)
    vh = vv.transpose(0, 2, 1, 3)
    scores = (qh @ kh.transpose(0, 1, 3, 2)) / q.dtype.type(np.sqrt(hd))  # (B, nh, T, T)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    scores = np.where(mask, -np.inf, scores)
    mx = scores.max(axis=-1, keepdims=True)  # (B, nh, T, 1)
    p = np.exp(scores - mx)
    denom = p.sum(axis=-1, keepdims=True)
    p /= denom
    out = p @ vh  # (B, nh, T, hd)
    lse = (mx + np.log(denom))[..., 0]  # (B, nh, T)
    return out.transpose(0, 2, 1, 3).astype(q.dtype, copy=False), lse.astype(q.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up``, elementwise."""
    return (silu(gate) * up).astype(gate.dtype, copy=False)


def residual_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def llama_block(
    x: np.ndarray,
    weights: dict,
    n_heads: int,
    n_kv_heads: int,
    eps: float = 1e-6,
    theta: float = 10000.0,
) -> np.ndarray:
    """A Hugging Face ``LlamaDecoderLayer`` (no bias, no cache, positions 0..T-1, causal) on
    ``x`` (B, T, H), with ``weights`` named like its ``state_dict()``; returns (B, T, H)."""
    b, t, h = x.shape
    hd = h // n_heads
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    x2d = x.reshape(b * t, h)  # (M, H)
    hn = rmsnorm(x2d, w["input_layernorm.weight"], eps)  # (M, H)
    q = linear(hn, w["self_attn.q_proj.weight"]).reshape(b, t, n_heads, hd)  # (B, T, nh, hd)
    k = linear(hn, w["self_attn.k_proj.weight"]).reshape(b, t, n_kv_heads, hd)  # (B, T, nkv, hd)
    v = linear(hn, w["self_attn.v_proj.weight"]).reshape(b, t, n_kv_heads, hd)  # (B, T, nkv, hd)
    a = attention(rope(q, theta), rope(k, theta), v).reshape(b * t, n_heads * hd)  # (M, nh*hd)
    x2 = residual_add(x2d, linear(a, w["self_attn.o_proj.weight"]))  # (M, H)
    hn = rmsnorm(x2, w["post_attention_layernorm.weight"], eps)  # (M, H)
    s = swiglu(linear(hn, w["mlp.gate_proj.weight"]), linear(hn, w["mlp.up_proj.weight"]))  # (M, F)
    out = residual_add(x2, linear(s, w["mlp.down_proj.weight"]))  # (M, H)
    return out.reshape(b, t, h)


# ---------------------------------------------------------------------------------------------
# Backward. Each function returns the gradients of a scalar loss with respect to the inputs of
# the forward function of the same name, given the gradient ``dy`` of its output. They work in
# the dtype they are given (the tests difference the float64 forward to check them).
# ---------------------------------------------------------------------------------------------


def linear_backward_x(dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``dx = dy @ w`` for ``y = x @ w.T``: dy (M, N), w (N, K); returns (M, K)."""
    return dy @ w


def linear_backward_w(dy: np.ndarray, x: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """``dw = dy.T @ x`` (+ ``acc``, an existing gradient) for ``y = x @ w.T``: dy (M, N),
    x (M, K); returns (N, K)."""
    g = dy.T @ x
    return g if acc is None else acc + g


def rmsnorm_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray, eps: float = 1e-6):
    """Gradients ``(dx, dw)`` of :func:`rmsnorm` over rows of x (..., H): with
    ``r = 1 / sqrt(mean(x**2) + eps)`` and ``xh = x r``, ``dw = sum_rows dy xh`` and
    ``dx = r (dy w - xh mean(dy w xh))``."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))  # (..., 1)
    xh = x * inv
    g = dy * w
    dx = inv * (g - xh * np.mean(g * xh, axis=-1, keepdims=True))
    dw = (dy * xh).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx.astype(x.dtype, copy=False), dw.astype(x.dtype, copy=False)


def rope_backward(dy: np.ndarray, theta: float = 10000.0, offset: int = 0) -> np.ndarray:
    """RoPE rotates each pair ``(x_i, x_{i+hd/2})`` by an angle; its gradient rotates ``dy`` back
    by the same angle (the transpose of a rotation is its inverse)."""
    _, t, _, hd = dy.shape
    cos, sin = rope_cos_sin(t, hd, theta, offset)
    cos = cos[None, :, None, :]  # (1, T, 1, hd)
    sin = sin[None, :, None, :]
    half = hd // 2
    back = np.concatenate([dy[..., half:], -dy[..., :half]], axis=-1)  # rotate_half transposed
    return (dy * cos + back * sin).astype(dy.dtype, copy=False)


def attention_backward(q, k, v, o, lse, do):
    """Gradients ``(dq, dk, dv)`` of causal GQA attention, the softmax recomputed from the saved
    row statistics ``lse`` (B, nh, T): ``P = exp(S - lse)``, ``dV = P^T dO``,
    ``dS = P (dO V^T - rowsum(dO o))``, ``dQ = dS K / sqrt(hd)``, ``dK = dS^T Q / sqrt(hd)``;
    key/value gradients summed over the query heads of each group."""
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    scale = q.dtype.type(1.0 / np.sqrt(hd))
    qh = q.transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    kh = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    vh = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    oh, doh = o.transpose(0, 2, 1, 3), do.transpose(0, 2, 1, 3)
    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale  # (B, nh, T, T)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    p = np.where(mask, 0.0, np.exp(np.where(mask, 0.0, s) - lse[..., None])).astype(q.dtype)
    dv = p.transpose(0, 1, 3, 2) @ doh  # (B, nh, T, hd)
    dp = doh @ vh.transpose(0, 1, 3, 2)  # (B, nh, T, T)
    d = np.sum(doh * oh, axis=-1, keepdims=True)  # (B, nh, T, 1)
    ds = p * (dp - d)
    dq = (ds @ kh) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ qh) * scale

    def kv(a):  # (B, nh, T, hd) -> (B, T, nkv, hd), summed over each group's query heads
        return a.reshape(b, nkv, group, t, hd).sum(axis=2).transpose(0, 2, 1, 3)

    return dq.transpose(0, 2, 1, 3).astype(q.dtype), kv(dk).astype(q.dtype), kv(dv).astype(q.dtype)


def swiglu_backward(gate: np.ndarray, up: np.ndarray, ds: np.ndarray):
    """Gradients ``(dgate, dup)`` of ``silu(gate) * up``:
    ``dup = ds silu(gate)``, ``dgate = ds up sig(gate) (1 + gate (1 - sig(gate)))``."""
    sig = 1.0 / (1.0 + np.exp(-gate))
    dup = ds * gate * sig
    dgate = ds * up * sig * (1.0 + gate * (1.0 - sig))
    return dgate.astype(gate.dtype, copy=False), dup.astype(gate.dtype, copy=False)


def adamw(w, g, m, v, *, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0, step: int = 1):
    """One ``torch.optim.AdamW`` step (``amsgrad=False``, decoupled decay); ``step`` counts from 1.
    Returns ``(w, m, v)`` after the step."""
    if step < 1:
        raise KernelError(f"adamw: step counts from 1, got {step}")
    m2 = beta1 * m + (1.0 - beta1) * g
    v2 = beta2 * v + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    w2 = w * (1.0 - lr * weight_decay) - (lr / bc1) * m2 / (np.sqrt(v2) / np.sqrt(bc2) + eps)
    dt = w.dtype
    return w2.astype(dt, copy=False), m2.astype(dt, copy=False), v2.astype(dt, copy=False)
