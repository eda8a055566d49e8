"""A LLaMA decoder block (Hugging Face ``LlamaDecoderLayer``, no KV cache) from the Numba kernels.

    h   = rmsnorm(x) ; q, k, v = h Wq^T, h Wk^T, h Wv^T ; rope(q), rope(k)
    x2  = x + attention(q, k, v) Wo^T
    out = x2 + (silu(rmsnorm(x2) Wg^T) * rmsnorm(x2) Wu^T) Wd^T

``llama_block_forward(x, weights, config)`` is the one-call API; ``LlamaBlock`` keeps the device
weights and the activation buffers of one (batch, seq) so that repeated calls (the benchmark)
allocate nothing.

``config.dtype`` picks the path: "float32" (the CUDA-core kernels, unchanged) or "bfloat16":
bf16 weights and activations (uint16 bit patterns on the device), the GEMMs on the tensor cores
(:mod:`.gemm_bf16`, fp32 accumulation, one rounding per output), RMSNorm's sum of squares, RoPE,
SwiGLU and the residual adds in fp32 rounded once per op where ``transformers`` rounds
(:mod:`.bf16`), attention with fp32 scores, softmax and accumulation and a bf16 output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from vmstoolkit.errors import KernelError

from . import bf16 as B
from ._util import check_float32, is_device_array, to_device
from .attention import attention, workspace_for
from .flash_bf16 import flash_attention_bf16
from .gemm import gemm
from .gemm_bf16 import gemm_bf16
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

# dtype spellings -> the canonical name kept in LlamaBlockConfig.dtype
_DTYPES = {"float32": "float32", "fp32": "float32", "torch.float32": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16"}


def canonical_dtype(dtype) -> str:
    """"float32" or "bfloat16" from any spelling of them (a string, ``np.float32``, ``torch.bfloat16``),
    or a ValueError naming the value."""
    try:
        name = str(np.dtype(dtype)) if not isinstance(dtype, str) and "torch" not in str(dtype) else str(dtype)
    except TypeError:
        name = str(dtype)
    if name not in _DTYPES:
        raise KernelError(f"LlamaBlockConfig.dtype={dtype!r}: the block computes in float32 or bfloat16")
    return _DTYPES[name]


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
    dtype: str = "float32"  # weights and activations: "float32" or "bfloat16" (module docstring)

    def __init__(self, hidden_size: int = 2048, num_attention_heads: int = 16,
                 num_key_value_heads: int | None = None, intermediate_size: int = 5632,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, dtype="float32", **short):
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
        object.__setattr__(self, "dtype", canonical_dtype(dtype))

    @classmethod
    def from_hf(cls, config, dtype="float32") -> "LlamaBlockConfig":
        """From any object with ``transformers.LlamaConfig``'s attributes (a ``LlamaConfig``, a
        ``SimpleNamespace``...), computing in ``dtype`` (given, never read from the config's
        ``torch_dtype``: a checkpoint stored in bf16 still runs the fp32 path unless asked).
        Raises ValueError for what the kernels do not compute: RoPE
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
            dtype=dtype,
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


def _torch_bf16_bits(a):
    """A torch bf16 tensor as the same memory viewed as int16 (numba and numpy know no bf16); any
    other object unchanged."""
    if type(a).__module__.startswith("torch") and str(getattr(a, "dtype", "")) == "torch.bfloat16":
        import torch

        return a.view(torch.int16)
    return a


def _device_bf16(name: str, a, stream):
    """``a`` as a uint16 device array of bf16 bits: bf16 given as uint16/int16 (numpy, device, or a
    torch bf16 tensor) is taken as is; float32 is rounded to nearest even once (on the host, or on
    the device by :func:`.bf16.narrow`), as ``module.to(torch.bfloat16)`` does; anything else is a
    ValueError naming ``name`` and the dtype."""
    a = _torch_bf16_bits(a)
    if is_device_array(a):
        d = to_device(a, stream)
        if B.is_bf16(d):
            return B.as_u16(d)
        check_float32(f"{name} (bf16 bits or float32)", d)
        out = cuda.device_array(tuple(d.shape), dtype=np.uint16, stream=stream)
        B.narrow(d, out, stream)
        return out
    h = np.asarray(a)
    if B.is_bf16(h):
        return cuda.to_device(np.ascontiguousarray(B.as_u16(h)), stream=stream)
    check_float32(f"{name} (bf16 bits or float32)", h)
    return cuda.to_device(B.to_bits(h), stream=stream)


def load_weights(weights: dict, config: LlamaBlockConfig, stream=0) -> dict:
    """Check names, shapes and dtypes of a HF-style state dict; return device arrays (float32, or
    uint16 bf16 bits for ``config.dtype == "bfloat16"``)."""
    config.check()
    shapes = config.weight_shapes()
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(
        n for n in set(weights) - set(shapes) if not n.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected:
        raise KernelError(f"weights: missing {missing}, unexpected {unexpected}")
    device = _device_bf16 if config.dtype == "bfloat16" else _device_float32
    out = {}
    for name, shape in shapes.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise KernelError(f"weights[{name!r}] has shape {got}, expected {shape} for {config}")
        out[name] = device(f"weights[{name!r}]", weights[name], stream)
    return out


class LlamaBlock:
    """Device weights plus the activation buffers of one (batch, seq); ``forward_device``
    enqueues the 14 kernel launches on a stream and allocates nothing.

    Activation memory: 5 (M, H) + 2 (M, nkv*hd) + 2 (M, F) buffers of ``config.dtype``, M =
    batch * seq, and the attention's split-KV workspace when it splits at this shape (few
    blocks: small M). In bf16 the attention is the bf16 flash kernel (:mod:`.flash_bf16`: P rounded
    to bf16 for the tensor cores, as SDPA's flash backend does) where the head dim is a multiple
    of 16; other head dims keep the fp32 kernel on float32 copies of q, k, v, (M, 2 nh*hd +
    2 nkv*hd), widened exactly, the output rounded back.
    """

    def __init__(self, weights: dict, config: LlamaBlockConfig, batch: int, seq: int, stream=0):
        self.config = config
        self.w = load_weights(weights, config, stream)
        self.batch, self.seq = batch, seq
        c = config
        m, h, f, hd = batch * seq, c.hidden_size, c.ffn_size, c.head_dim
        nq, nkv = c.n_heads * hd, c.n_kv_heads * hd
        self.bf16 = c.dtype == "bfloat16"
        dt = np.uint16 if self.bf16 else np.float32

        def buf(*shape, dtype=dt):
            return cuda.device_array(shape, dtype=dtype, stream=stream)

        self.h = buf(m, h)  # (M, H) normed input, reused for the second norm
        self.q = buf(m, nq)  # (M, nh*hd)
        self.k = buf(m, nkv)  # (M, nkv*hd)
        self.v = buf(m, nkv)  # (M, nkv*hd)
        self.a = buf(m, nq)  # (M, nh*hd) attention output
        self.t = buf(m, h)  # (M, H) projection output before each residual add
        self.x2 = buf(m, h)  # (M, H) residual stream after attention
        self.g = buf(m, f)  # (M, F) gate, then silu(gate) * up
        self.u = buf(m, f)  # (M, F) up
        self.flash = self.bf16 and hd % 16 == 0  # the bf16 flash kernel (class docstring)
        if self.bf16 and not self.flash:  # the attention's float32 operands (class docstring)
            self.q32, self.a32 = buf(m, nq, dtype=np.float32), buf(m, nq, dtype=np.float32)
            self.k32, self.v32 = buf(m, nkv, dtype=np.float32), buf(m, nkv, dtype=np.float32)
        # split-KV partial outputs, when the attention launch splits at this shape
        self.att_ws = workspace_for(batch, seq, c.n_heads, c.n_kv_heads, hd, stream) if m and not self.flash else None

    def forward_device(self, x, out, stream=0) -> None:
        """Enqueue the block on ``stream``: x and out are (B, T, H) device arrays of the config's
        dtype (bf16: uint16 or int16 bits)."""
        c = self.config
        b, t = self.batch, self.seq
        expect = (b, t, c.hidden_size)
        if tuple(x.shape) != expect or tuple(out.shape) != expect:
            raise KernelError(
                f"block input {tuple(x.shape)} / output {tuple(out.shape)}: expected {expect}"
            )
        if self.bf16:
            B.check_bf16("block input", x)
            B.check_bf16("block output", out)
            self._forward(B.as_u16(x), B.as_u16(out), stream)
        else:
            check_float32("block input", x)
            check_float32("block output", out)
            self._forward(x, out, stream)

    def _views(self):
        c, b, t, hd = self.config, self.batch, self.seq, self.config.head_dim
        return (self.q.reshape(b, t, c.n_heads, hd),  # (B, T, nh, hd)
                self.k.reshape(b, t, c.n_kv_heads, hd),  # (B, T, nkv, hd)
                self.v.reshape(b, t, c.n_kv_heads, hd),  # (B, T, nkv, hd)
                self.a.reshape(b, t, c.n_heads, hd))  # (B, T, nh, hd)

    def _ops(self):
        """(rmsnorm, gemm, rope, attention, residual_add, swiglu) of the config's dtype, each with
        the fp32 kernels' signature."""
        if not self.bf16:
            return (rmsnorm, gemm, rope, lambda q4, k4, v4, a4, stream: attention(
                q4, k4, v4, a4, stream, workspace=self.att_ws), residual_add, swiglu)
        return (B.rmsnorm_bf16, gemm_bf16, B.rope_bf16, lambda q4, k4, v4, a4, stream: self._attention_bf16(stream),
                B.residual_add_bf16, B.swiglu_bf16)

    def _forward(self, x, out, stream) -> None:
        c, w = self.config, self.w
        norm, mm, rot, att, add, act = self._ops()
        m = self.batch * self.seq
        x2d = x.reshape(m, c.hidden_size)  # (M, H)
        out2d = out.reshape(m, c.hidden_size)  # (M, H)
        q4, k4, v4, a4 = self._views()

        norm(x2d, w["input_layernorm.weight"], self.h, c.rms_eps, stream)  # (M, H)
        mm(self.h, w["self_attn.q_proj.weight"], self.q, stream)  # (M, nh*hd)
        mm(self.h, w["self_attn.k_proj.weight"], self.k, stream)  # (M, nkv*hd)
        mm(self.h, w["self_attn.v_proj.weight"], self.v, stream)  # (M, nkv*hd)
        rot(q4, q4, c.rope_theta, 0, stream)  # (B, T, nh, hd), in place
        rot(k4, k4, c.rope_theta, 0, stream)  # (B, T, nkv, hd), in place
        att(q4, k4, v4, a4, stream)  # (B, T, nh, hd)
        mm(self.a, w["self_attn.o_proj.weight"], self.t, stream)  # (M, H)
        add(x2d, self.t, self.x2, stream)  # (M, H)
        norm(self.x2, w["post_attention_layernorm.weight"], self.h, c.rms_eps, stream)
        mm(self.h, w["mlp.gate_proj.weight"], self.g, stream)  # (M, F)
        mm(self.h, w["mlp.up_proj.weight"], self.u, stream)  # (M, F)
        act(self.g, self.u, self.g, stream)  # (M, F), in place
        mm(self.g, w["mlp.down_proj.weight"], self.t, stream)  # (M, H)
        add(self.x2, self.t, out2d, stream)  # (M, H)

    def _attention_bf16(self, stream) -> None:
        """a = attention(q, k, v), bf16 in and out: the bf16 flash kernel, or (a head dim it does
        not take) widened exactly to fp32, the fp32 kernel, one rounding of the output."""
        c, b, t, hd = self.config, self.batch, self.seq, self.config.head_dim
        if self.flash:
            flash_attention_bf16(*self._views(), stream=stream)
            return
        for src, dst in ((self.q, self.q32), (self.k, self.k32), (self.v, self.v32)):
            B.widen(src, dst, stream)
        attention(self.q32.reshape(b, t, c.n_heads, hd), self.k32.reshape(b, t, c.n_kv_heads, hd),
                  self.v32.reshape(b, t, c.n_kv_heads, hd), self.a32.reshape(b, t, c.n_heads, hd), stream,
                  workspace=self.att_ws)  # (B, T, nh, hd)
        B.narrow(self.a32, self.a, stream)


def _input(x, config: LlamaBlockConfig, stream):
    """(device array of x, shape, how to hand the output back)."""
    bf16 = config.dtype == "bfloat16"
    if bf16:
        x = _torch_bf16_bits(x)
    if is_device_array(x):
        d_x = to_device(x, stream)
        if bf16 and not B.is_bf16(d_x):
            check_float32("x (bf16 bits or float32)", d_x)
            raise KernelError(f"x is a float32 device array but config.dtype='bfloat16': give its bf16 "
                              f"bits (uint16/int16, or a torch bf16 tensor), shape {tuple(d_x.shape)}")
        if not bf16:
            check_float32("x", d_x)
        return d_x, tuple(d_x.shape), "device"
    h = np.asarray(x)
    if not bf16:
        check_float32("x", h)
        return h, tuple(h.shape), "host"
    if B.is_bf16(h):
        return B.as_u16(h), tuple(h.shape), "bits-" + np.dtype(h.dtype).name
    check_float32("x (bf16 bits or float32)", h)
    return B.to_bits(h), tuple(h.shape), "values"


def llama_block_forward(x, weights: dict, config: LlamaBlockConfig, stream=0):
    """One LLaMA decoder block, positions 0..seq-1, causal mask.

    ``x``: (batch, seq, hidden), numpy or device array. ``weights``: a HF
    ``LlamaDecoderLayer.state_dict()`` (numpy arrays, CPU or CUDA torch tensors, or device arrays).

    float32 config: x float32; returns float32 (batch, seq, hidden) in the form of ``x``
    (numpy in, numpy out; device in, device out).

    bfloat16 config: x as bf16 bits (uint16/int16 numpy or device arrays, or a torch bf16
    tensor), or float32 numpy values rounded to bf16 first; weights likewise (float32 ones
    rounded once). Returns bf16 bits for bits (numpy of x's dtype; a uint16 device array for a
    device or torch input), the float32 values of the bf16 output for float32 numpy input.
    """
    config.check()
    h, shape, form = _input(x, config, stream)
    if len(shape) != 3 or shape[2] != config.hidden_size:
        raise KernelError(f"x has shape {shape}, expected (batch, seq, {config.hidden_size})")
    d_x = h if form == "device" else cuda.to_device(np.ascontiguousarray(h), stream=stream)
    b, t, _ = shape
    block = LlamaBlock(weights, config, b, t, stream)
    dt = np.uint16 if config.dtype == "bfloat16" else np.float32
    d_out = cuda.device_array(shape, dtype=dt, stream=stream)  # (B, T, H)
    if b * t:
        block.forward_device(B.as_u16(d_x) if block.bf16 else d_x, d_out, stream)
    if form == "device":
        return d_out
    out = d_out.copy_to_host(stream=stream)  # (B, T, H)
    if stream != 0:
        stream.synchronize()
    if form == "values":
        return B.values(out)
    if form.startswith("bits-"):
        return out.view(np.dtype(form[5:]))
    return out
