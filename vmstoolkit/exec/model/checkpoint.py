"""A local Hugging Face model folder: ``config.json`` and ``*.safetensors`` shards, with or
without ``model.safetensors.index.json``; nothing is ever downloaded.

Each shard is opened with the ``safetensors`` package (``safe_open(..., framework="numpy")``),
which checks its header against the file (a truncated or corrupt shard is refused there, in one
line naming the file), then memory-mapped once (``np.memmap``, read-only): a float32 tensor is a
view of the mapped file, so frozen weights cost page cache, not a RAM copy, and are read only
where a run touches them. float16 and bfloat16 tensors are widened to float32 on first read (a
copy; the runtime computes in float32). The offsets of the views come from the same header
safetensors has just validated (8 bytes of length, then JSON).

:meth:`Checkpoint.check` makes sure every tensor the model needs is there with its shape, before
any run: a missing or misshapen tensor is named.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vmstoolkit.exec.errors import CheckpointError
from vmstoolkit.exec.model.config import ModelConfig, read_config

INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class _Entry:
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    stop: int


def hf_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the runtime reads, by its Hugging Face name, with its shape."""
    h, hd = cfg.hidden, cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab, h), "model.norm.weight": (h,)}
    if not cfg.tied:
        out["lm_head.weight"] = (cfg.vocab, h)
    for i in range(cfg.n_blocks):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.heads * hd, h), p + "self_attn.k_proj.weight": (cfg.kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (cfg.kv_heads * hd, h), p + "self_attn.o_proj.weight": (h, cfg.heads * hd),
            p + "mlp.gate_proj.weight": (cfg.ffn, h), p + "mlp.up_proj.weight": (cfg.ffn, h),
            p + "mlp.down_proj.weight": (h, cfg.ffn),
        })
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (cfg.heads * hd,), p + "self_attn.k_proj.bias": (cfg.kv_heads * hd,),
                        p + "self_attn.v_proj.bias": (cfg.kv_heads * hd,)})
    return out


class Checkpoint:
    """The tensors of a model folder, by Hugging Face name, read lazily from memory-mapped shards."""

    def __init__(self, folder):
        self.folder = Path(folder).expanduser()
        self.config = read_config(self.folder)
        self._entries: dict[str, _Entry] = {}
        self._maps: dict[Path, np.memmap] = {}
        for shard in self._shards():
            self._open(shard)
        self.check()

    def _shards(self) -> list[Path]:
        index = self.folder / INDEX
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                names = sorted(set(wm.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a shard index with a weight_map ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())})") from None
            shards = []
            for n in names:
                p = self.folder / n
                if not isinstance(n, str) or Path(n).name != n or not p.is_file():
                    raise CheckpointError(f"{self.folder}: shard {n!r} named by {INDEX} is missing")
                shards.append(p)
            self._index = wm
            return shards
        self._index = None
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            bins = sorted(p.name for p in self.folder.glob("*.bin"))
            hint = f" (found {bins[0]}: convert it to safetensors first)" if bins else ""
            raise CheckpointError(f"{self.folder} has no *.safetensors file{hint}")
        return shards

    def _open(self, shard: Path) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(shard), framework="numpy") as f:
                keys = list(f.keys())
            with open(shard, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
            raise CheckpointError(f"{shard}: corrupt or truncated safetensors file ({' '.join(str(e).split())})") from None
        base = 8 + n
        for k in keys:
            meta = header[k]
            start, stop = meta["data_offsets"]
            if self._index is not None and self._index.get(k) not in (None, shard.name):
                continue  # the index names another shard for this tensor
            if k in self._entries:
                raise CheckpointError(f"{self.folder}: tensor {k!r} is in both {self._entries[k].shard.name} and "
                                      f"{shard.name}")
            self._entries[k] = _Entry(shard, meta["dtype"], tuple(meta["shape"]), base + start, base + stop)

    def check(self) -> None:
        """Every tensor the model needs is present with its shape and a float dtype."""
        for name, shape in hf_names(self.config).items():
            e = self._entries.get(name)
            if e is None:
                if self._index is not None and name in self._index:
                    raise CheckpointError(f"{self.folder}: tensor {name!r} is not in {self._index[name]}, where "
                                          f"{INDEX} puts it")
                raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
            if e.shape != shape:
                raise CheckpointError(f"{e.shard.name}: tensor {name!r} has shape {list(e.shape)}, config.json "
                                      f"implies {list(shape)}")
            if e.dtype not in _DTYPES:
                raise CheckpointError(f"{e.shard.name}: tensor {name!r} has dtype {e.dtype}; the runtime reads "
                                      f"F32, F16 and BF16")

    def names(self) -> list[str]:
        return list(self._entries)

    def _map(self, shard: Path) -> np.memmap:
        m = self._maps.get(shard)
        if m is None:
            m = self._maps[shard] = np.memmap(shard, dtype=np.uint8, mode="r")
        return m

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32: a read-only view of the mapped file for F32, a widened
        copy for F16 and BF16."""
        e = self._entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        raw = self._map(e.shard)[e.start:e.stop]
        a = raw.view(_DTYPES[e.dtype]).reshape(e.shape)
        if e.dtype == "F32":
            return a
        if e.dtype == "F16":
            return a.astype(np.float32)
        return (a.astype(np.uint32) << 16).view(np.float32)  # bfloat16: the high half of a float32

    def is_mapped(self, name: str) -> bool:
        """Whether :meth:`get` returns a view of the file (no RAM copy)."""
        return self._entries[name].dtype == "F32"

    def nbytes_f32(self) -> int:
        return sum(4 * int(np.prod(s)) for s in hf_names(self.config).values())

    def __repr__(self) -> str:
        c = self.config
        return (f"Checkpoint({self.folder.name}: {c.model_type}, {c.n_blocks} blocks, hidden {c.hidden}, heads "
                f"{c.heads}/{c.kv_heads}, {len(set(e.shard for e in self._entries.values()))} shard(s))")


def load_model(folder) -> Checkpoint:
    """Open a Hugging Face model folder (config and every tensor checked; nothing read yet)."""
    return Checkpoint(folder)
