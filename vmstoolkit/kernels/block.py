"""A LLaMA decoder block (Hugging Face ``LlamaDecoderLayer``, no KV cache) from the Numba kernels.

    h   = rmsnorm(x) ; q, k, v = h Wq^T, h Wk^T, h Wv^T ; rope(q), rope(k)
    x2  = x + attention(q, k, v) Wo^T
    out = x2 + (silu(rmsnorm(x2) Wg^T) * rmsnorm(x2) Wu^T) Wd^T

``llama_block_forward(x, weights, config)`` is the one-call API; ``LlamaBlock`` keeps the device
weights and the activation buffers of one (batch, seq) so that repeated calls (the benchmark)
allocate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from vmstoolkit.errors import KernelError

from ._util import check_float32, is_device_array, to_device
from .attention import attention, workspace_for
from .gemm import gemm
from .residual import residual_add
from .rmsnorm import rmsnorm
from .rope import rope
from .swiglu import swiglu


# Short names kept from before the Hugging Face names (issue 18): keyword aliases and properties.
_SHORT_NAMES = {
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_size": "intermediate_size",
    "rms_eps": "rms_norm_eps",
}


@dataclass(frozen=True, init=False)
class LlamaBlockConfig:
    """Sizes of one decoder block, under the names of ``transformers.LlamaConfig``. Defaults: the
    H200 acceptance shape (TinyLlama-1.1B's width and FFN with 16 full heads), HF ``LlamaConfig``
    defaults for eps and theta.

    ``LlamaBlockConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336)`` or ``LlamaBlockConfig.from_hf(llama_config)``; the short names
    (``n_heads``, ``n_kv_heads``, ``ffn_size``, ``rms_eps``) work as keywords and properties.
    ``num_key_value_heads=None`` means ``num_attention_heads`` (HF's rule).
    """

    hidden_size: int = 2048  # model width H
    num_attention_heads: int = 16  # query heads; head_dim = H // heads = 128
    num_key_value_heads: int = 16  # key/value heads; fewer = grouped-query attention
    intermediate_size: int = 5632  # SwiGLU inner width F (TinyLlama: 2.75 x 2048)
    rms_norm_eps: float = 1e-6  # HF LlamaConfig.rms_norm_eps default
    rope_theta: float = 10000.0  # HF LlamaConfig.rope_theta default

    def __init__(self, hidden_size: int = 2048, num_attention_heads: int = 16,
                 num_key_value_heads: int | None = None, intermediate_size: int = 5632,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, **short):
        unknown = sorted(set(short) - set(_SHORT_NAMES))
        if unknown:
            raise TypeError(f"LlamaBlockConfig got unexpected keyword arguments {unknown}")
        given = {"num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
                 "intermediate_size": intermediate_size, "rms_norm_eps": rms_norm_eps}
        for alias, name in _SHORT_NAMES.items():
            if alias in short:
                given[name] = short[alias]
        if given["num_key_value_heads"] is None:
            given["num_key_value_heads"] = given["num_attention_heads"]
        object.__setattr__(self, "hidden_size", hidden_size)
        for name, value in given.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "rope_theta", rope_theta)

    @classmethod
    def from_hf(cls, config) -> "LlamaBlockConfig":
        """From any object with ``transformers.LlamaConfig``'s attributes (a ``LlamaConfig``, a
        ``SimpleNamespace``...). Raises ValueError for what the kernels do not compute: RoPE
        scaling, an activation other than SiLU, biases, or a ``head_dim`` that is not
        ``hidden_size // num_attention_heads``."""
        missing = [n for n in ("hidden_size", "num_attention_heads", "intermediate_size")
                   if not hasattr(config, n)]
        if missing:
            raise KernelError(f"LlamaBlockConfig.from_hf: {type(config).__name__} has no {missing}")
        theta = getattr(config, "rope_theta", None)
        rope_params = getattr(config, "rope_parameters", None) or {}
        if theta is None:  # transformers >= 5 keeps it in rope_parameters
            theta = rope_params.get("rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type")) or rope_params.get("rope_type", "default")
        if kind != "default":
            raise KernelError(f"LlamaBlockConfig.from_hf: rope scaling {kind!r} is not supported "
                             f"(the kernels apply plain RoPE)")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise KernelError(f"LlamaBlockConfig.from_hf: hidden_act={act!r}, the kernels compute SiLU")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise KernelError(f"LlamaBlockConfig.from_hf: {flag}=True is not supported (no biases)")
        out = cls(
            hidden_size=int(config.hidden_size),
            num_attention_heads=int(config.num_attention_heads),
            num_key_value_heads=getattr(config, "num_key_value_heads", None),
            intermediate_size=int(config.intermediate_size),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
        )
        hd = getattr(config, "head_dim", None)
        if hd is not None and hd != out.head_dim:
            raise KernelError(f"LlamaBlockConfig.from_hf: head_dim={hd} but hidden_size // "
                             f"num_attention_heads = {out.head_dim}; the kernels need them equal")
        return out

    @property
    def n_heads(self) -> int:
        return self.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    @property
    def rms_eps(self) -> float:
        return self.rms_norm_eps

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def check(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise KernelError(f"LlamaBlockConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.n_heads:
            raise KernelError(
                f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise KernelError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise KernelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rms_eps < 0 or self.rope_theta <= 0:
            raise KernelError(f"rms_eps={self.rms_eps} must be >= 0, rope_theta={self.rope_theta} > 0")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of a HF ``LlamaDecoderLayer.state_dict()`` (linear: (out, in))."""
        h, f, hd = self.hidden_size, self.ffn_size, self.head_dim
        return {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (self.n_heads * hd, h),
            "self_attn.k_proj.weight": (self.n_kv_heads * hd, h),
            "self_attn.v_proj.weight": (self.n_kv_heads * hd, h),
            "self_attn.o_proj.weight": (h, self.n_heads * hd),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }


# state_dict entries that carry no parameter of the computation (older HF versions).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _device_float32(name: str, a, stream):
    """``a`` (numpy, torch or device array) as a float32 device array, or a ValueError."""
    if is_device_array(a):
        d = to_device(a, stream)
        check_float32(name, d)
        return d
    h = np.asarray(a)
    check_float32(name, h)
    return cuda.to_device(np.ascontiguousarray(h), stream=stream)


def load_weights(weights: dict, config: LlamaBlockConfig, stream=0) -> dict:
    """Check names, shapes and dtypes of a HF-style state dict; return device arrays."""
    config.check()
    shapes = config.weight_shapes()
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(
        n for n in set(weights) - set(shapes) if not n.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected:
        raise KernelError(f"weights: missing {missing}, unexpected {unexpected}")
    out = {}
    for name, shape in shapes.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise KernelError(f"weights[{name!r}] has shape {got}, expected {shape} for {config}")
        out[name] = _device_float32(f"weights[{name!r}]", weights[name], stream)
    return out


class LlamaBlock:
    """Device weights plus the activation buffers of one (batch, seq); ``forward_device``
    enqueues the 14 kernel launches on a stream and allocates nothing.

    Activation memory: 5 (M, H) + 2 (M, nkv*hd) + 2 (M, F) float32 buffers, M = batch * seq,
    and the attention's split-KV workspace when it splits at this shape (few blocks: small M).
    """

    def __init__(self, weights: dict, config: LlamaBlockConfig, batch: int, seq: int, stream=0):
        self.config = config
        self.w = load_weights(weights, config, stream)
        self.batch, self.seq = batch, seq
        c = config
        m, h, f, hd = batch * seq, c.hidden_size, c.ffn_size, c.head_dim
        nq, nkv = c.n_heads * hd, c.n_kv_heads * hd

        def buf(*shape):
            return cuda.device_array(shape, dtype=np.float32, stream=stream)

        self.h = buf(m, h)  # (M, H) normed input, reused for the second norm
        self.q = buf(m, nq)  # (M, nh*hd)
        self.k = buf(m, nkv)  # (M, nkv*hd)
        self.v = buf(m, nkv)  # (M, nkv*hd)
        self.a = buf(m, nq)  # (M, nh*hd) attention output
        self.t = buf(m, h)  # (M, H) projection output before each residual add
        self.x2 = buf(m, h)  # (M, H) residual stream after attention
        self.g = buf(m, f)  # (M, F) gate, then silu(gate) * up
        self.u = buf(m, f)  # (M, F) up
        # split-KV partial outputs, when the attention launch splits at this shape
        self.att_ws = workspace_for(batch, seq, c.n_heads, c.n_kv_heads, hd, stream) if m else None

    def forward_device(self, x, out, stream=0) -> None:
        """Enqueue the block on ``stream``: x and out are (B, T, H) float32 device arrays."""
        c, w = self.config, self.w
        b, t, hd = self.batch, self.seq, c.head_dim
        m = b * t
        expect = (b, t, c.hidden_size)
        if tuple(x.shape) != expect or tuple(out.shape) != expect:
            raise KernelError(
                f"block input {tuple(x.shape)} / output {tuple(out.shape)}: expected {expect}"
            )
        x2d = x.reshape(m, c.hidden_size)  # (M, H)
        out2d = out.reshape(m, c.hidden_size)  # (M, H)
        q4 = self.q.reshape(b, t, c.n_heads, hd)  # (B, T, nh, hd)
        k4 = self.k.reshape(b, t, c.n_kv_heads, hd)  # (B, T, nkv, hd)
        v4 = self.v.reshape(b, t, c.n_kv_heads, hd)  # (B, T, nkv, hd)
        a4 = self.a.reshape(b, t, c.n_heads, hd)  # (B, T, nh, hd)

        rmsnorm(x2d, w["input_layernorm.weight"], self.h, c.rms_eps, stream)  # (M, H)
        gemm(self.h, w["self_attn.q_proj.weight"], self.q, stream)  # (M, nh*hd)
        gemm(self.h, w["self_attn.k_proj.weight"], self.k, stream)  # (M, nkv*hd)
        gemm(self.h, w["self_attn.v_proj.weight"], self.v, stream)  # (M, nkv*hd)
        rope(q4, q4, c.rope_theta, 0, stream)  # (B, T, nh, hd), in place
        rope(k4, k4, c.rope_theta, 0, stream)  # (B, T, nkv, hd), in place
        attention(q4, k4, v4, a4, stream, workspace=self.att_ws)  # (B, T, nh, hd)
        gemm(self.a, w["self_attn.o_proj.weight"], self.t, stream)  # (M, H)
        residual_add(x2d, self.t, self.x2, stream)  # (M, H)
        rmsnorm(self.x2, w["post_attention_layernorm.weight"], self.h, c.rms_eps, stream)
        gemm(self.h, w["mlp.gate_proj.weight"], self.g, stream)  # (M, F)
        gemm(self.h, w["mlp.up_proj.weight"], self.u, stream)  # (M, F)
        swiglu(self.g, self.u, self.g, stream)  # (M, F), in place
        gemm(self.g, w["mlp.down_proj.weight"], self.t, stream)  # (M, H)
        residual_add(self.x2, self.t, out2d, stream)  # (M, H)


def llama_block_forward(x, weights: dict, config: LlamaBlockConfig, stream=0):
    """One LLaMA decoder block, positions 0..seq-1, causal mask.

    ``x``: (batch, seq, hidden) float32, numpy or device array. ``weights``: a HF
    ``LlamaDecoderLayer.state_dict()`` (numpy arrays, CPU or CUDA torch tensors, or device
    arrays). Returns (batch, seq, hidden) float32 in the same form as ``x`` (numpy in, numpy out).
    """
    config.check()
    on_device = is_device_array(x)
    if on_device:
        d_x = to_device(x, stream)
    else:
        x = np.asarray(x)
    check_float32("x", d_x if on_device else x)
    shape = tuple(x.shape)
    if len(shape) != 3 or shape[2] != config.hidden_size:
        raise KernelError(f"x has shape {shape}, expected (batch, seq, {config.hidden_size})")
    if not on_device:
        d_x = cuda.to_device(np.ascontiguousarray(x), stream=stream)
    b, t, _ = shape
    block = LlamaBlock(weights, config, b, t, stream)
    d_out = cuda.device_array(shape, dtype=np.float32, stream=stream)  # (B, T, H)
    if b * t:
        block.forward_device(d_x, d_out, stream)
    if on_device:
        return d_out
    out = d_out.copy_to_host(stream=stream)  # (B, T, H)
    if stream != 0:
        stream.synchronize()
    return out
