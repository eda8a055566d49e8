"""A Hugging Face ``config.json`` of a LLaMA, Mistral or Qwen2 causal LM, read and checked.

:func:`read_config` turns the file into a :class:`ModelConfig` or refuses it with one line naming
the field and its value: anything the runtime would otherwise compute differently from
``transformers`` (scaled or partial rotary embeddings, a sliding window that is in use, another
activation, biases where the runtime has none, quantized weights) is an error, never ignored.
Both spellings of the rotary settings are read: ``rope_theta`` / ``rope_scaling`` (transformers 4)
and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from vmstoolkit.exec.errors import CheckpointError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs of a checkpoint's config (Hugging Face names in comments)."""

    model_type: str
    vocab: int  # vocab_size
    hidden: int  # hidden_size
    n_blocks: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, or hidden_size // num_attention_heads
    ffn: int  # intermediate_size
    eps: float  # rms_norm_eps
    rope_theta: float
    tied: bool  # tie_word_embeddings: the LM head is the embedding table
    qkv_bias: bool  # Qwen2: q, k and v projections have biases
    sliding_window: int | None = None  # Mistral's window (None: full attention)
    max_positions: int | None = None  # max_position_embeddings

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def check_positions(self, n: int) -> None:
        """Refuse a run over ``n`` positions that a sliding window would cut."""
        if self.sliding_window is not None and n > self.sliding_window:
            raise CheckpointError(f"sliding_window={self.sliding_window} is in use at {n} positions (prompt and new "
                                  f"tokens); the runtime has full causal attention only")

    def param_count(self) -> int:
        h, f = self.hidden, self.ffn
        block = h * self.q_dim * 2 + h * self.kv_dim * 2 + 3 * h * f + 2 * h
        if self.qkv_bias:
            block += self.q_dim + 2 * self.kv_dim
        return self.n_blocks * block + self.vocab * h * (1 if self.tied else 2) + h


def _bad(field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {field}={value!r} is not supported: {why}")


def _int(cfg: dict, field: str, default=None) -> int:
    v = cfg.get(field, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"config.json: {field}={v!r} must be a whole number of at least 1")
    return v


def _rope(cfg: dict) -> float:
    """``rope_theta`` from either spelling; anything but plain rotary embeddings refused."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _bad("rope_parameters", params, "expected a mapping")
        if "full_attention" in params and isinstance(params["full_attention"], dict):  # per layer type
            params = params["full_attention"]
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise _bad("rope_parameters.rope_type", kind, "only plain rotary embeddings (rope_type 'default')")
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        scaling = cfg.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
            if kind != "default":
                raise _bad("rope_scaling", scaling, "only plain rotary embeddings (no scaling)")
        theta = cfg.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise CheckpointError(f"config.json: rope_theta={theta!r} must be a positive number")
    for field in ("partial_rotary_factor",):
        v = cfg.get(field, (params or {}).get(field) if params else None)
        if v not in (None, 1, 1.0):
            raise _bad(field, v, "rotary embeddings must cover the whole head")
    return float(theta)


def parse_config(cfg: dict) -> ModelConfig:
    """A :class:`ModelConfig` from the dict of a ``config.json`` (errors: module docstring)."""
    mt = cfg.get("model_type")
    if mt not in ARCHITECTURES:
        raise _bad("model_type", mt, f"the runtime runs {', '.join(ARCHITECTURES)}")
    archs = cfg.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[mt]]:
        raise _bad("architectures", archs, f"a {mt} checkpoint for generation and training is {ARCHITECTURES[mt]}")
    if cfg.get("quantization_config") is not None:
        raise _bad("quantization_config", cfg["quantization_config"].get("quant_method", "?")
                   if isinstance(cfg["quantization_config"], dict) else cfg["quantization_config"],
                   "the runtime needs float weights")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _bad("hidden_act", act, "the FFN is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if mt != "qwen2" and cfg.get(field, False):
            raise _bad(field, cfg[field], f"{mt} projections without biases only")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise _bad("hidden_size", hidden, f"not divisible by num_attention_heads={heads} and no head_dim given")
        head_dim = hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise _bad("head_dim", head_dim, "rotary embeddings rotate the two halves of each head: it must be even")
    if heads % kv:
        raise _bad("num_key_value_heads", kv, f"it must divide num_attention_heads={heads}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise CheckpointError(f"config.json: rms_norm_eps={eps!r} must be a positive number")
    window = None
    if mt == "mistral":
        window = cfg.get("sliding_window")
        if window is not None:
            window = _int(cfg, "sliding_window")
    if mt == "qwen2":
        if cfg.get("use_sliding_window", False):
            raise _bad("use_sliding_window", cfg["use_sliding_window"], "the runtime has full causal attention only")
    types = cfg.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        odd = next(t for t in types if t != "full_attention")
        raise _bad("layer_types", odd, "every layer must be full_attention")
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise CheckpointError(f"config.json: tie_word_embeddings={tied!r} must be true or false")
    maxpos = cfg.get("max_position_embeddings")
    return ModelConfig(model_type=mt, vocab=_int(cfg, "vocab_size"), hidden=hidden, n_blocks=_int(cfg, "num_hidden_layers"),
                       heads=heads, kv_heads=kv, head_dim=head_dim, ffn=_int(cfg, "intermediate_size"),
                       eps=float(eps), rope_theta=_rope(cfg), tied=tied, qkv_bias=mt == "qwen2",
                       sliding_window=window, max_positions=maxpos if isinstance(maxpos, int) else None)


def read_config(folder: Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"model folder {folder} does not exist or is not a folder")
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json (a Hugging Face model folder has config.json and "
                              f"*.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({' '.join(str(e).split())})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return parse_config(cfg)
