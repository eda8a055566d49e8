"""Numpy references for the LLaMA decoder block operations.

These are the ground truth that every Numba kernel is validated against, and the kernels that
the runtime's simulated backend executes. Conventions follow Hugging Face ``transformers``:
linear weights are ``(out_features, in_features)``, RoPE uses ``rotate_half`` on the two halves
of each head, attention is causal with grouped-query heads (``n_heads % n_kv_heads == 0``).

All functions are pure: they never write into their inputs.
"""

from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``y = x @ w.T`` for ``x`` of shape (M, K) and ``w`` of shape (N, K); returns (M, N)."""
    return x @ w.T


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * w``."""
    x32 = x.astype(np.float32, copy=False)
    var = np.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 / np.sqrt(var + np.float32(eps))) * w


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
    scores = (qh @ kh.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(hd))  # (B, nh, T, T)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ vh  # (B, nh, T, hd)
    return out.transpose(0, 2, 1, 3).astype(q.dtype, copy=False)


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
