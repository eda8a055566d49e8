"""Task graphs: operations (vertices) over tensors, and a builder for LLaMA prefill.

A :class:`TaskGraph` lists tensors and vertices with integer ids. Vertices are kept in *program
order*, which is always a topological order of the data dependencies (a vertex only reads
tensors that were produced earlier, or weights and inputs that exist before the run).

Tensors are immutable once written (single assignment): that is what lets the compiler drop a
tensor from the GPU without copying it back when a clean host copy exists (weights, or an
activation that was already offloaded once).

The LLaMA builder follows Hugging Face conventions (see ``vmstoolkit.kernels.reference``):
linear weights are (out, in), heads are laid out head-major in the hidden dimension.
With ``parts > 1`` the GEMMs are split along the rows of their weight (output features) and
attention along heads, so that each weight part is its own tensor and can be loaded, dropped and
reloaded on its own; ``concat`` vertices join parts where the next operation needs a whole
tensor.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from vmstoolkit.exec.errors import InvalidGraphError, InvalidShapeError

# The compute operations a backend must implement. The kernel names are the contract of
# ``vmstoolkit.kernels.tasks.KERNEL_TASKS`` (the forward six, then the training tasks);
# ``concat`` (join column parts) and ``copy`` (GPU to GPU) are implemented by the backends.
KERNEL_OPS = ("linear", "rmsnorm", "rope", "attention", "swiglu", "residual_add")
TRAIN_OPS = ("linear_dx", "linear_dw", "rmsnorm_dx", "rmsnorm_dw", "rope_backward", "attention_lse",
             "attention_backward", "swiglu_backward", "adamw", "cross_entropy")
# The whole model's pieces beyond the blocks (``vmstoolkit.exec.model``: embedding, Qwen2's
# biases, the last row, the KV cache's growth, decoding over it, the greedy token).
MODEL_OPS = ("embedding", "bias_add", "take_rows", "append_rows", "attention_cached", "argmax")
COMPUTE_OPS = KERNEL_OPS + TRAIN_OPS + MODEL_OPS + ("concat", "copy")


class TensorKind(str, enum.Enum):
    WEIGHT = "weight"  # read-only, lives in host memory from the start
    INPUT = "input"  # given before the run, host copy exists
    ACTIVATION = "activation"  # written by a vertex during the run


@dataclass(frozen=True, slots=True)
class Tensor:
    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    gpu: int
    kind: TensorKind

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Vertex:
    """One operation. ``views`` gives the shape under which each input then output is handed
    to the kernel (a free reshape of the contiguous tensor)."""

    id: int
    name: str
    op: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    gpu: int
    params: dict = field(default_factory=dict, hash=False)
    views: tuple[tuple[int, ...], ...] = ()
    flops: float = 0.0


class TaskGraph:
    """Tensors and vertices in program order. Build with :meth:`tensor` and :meth:`add`."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.vertices: list[Vertex] = []
        self.producer: list[int] = []  # tensor id -> vertex id, -1 for weights and inputs
        self.outputs: list[int] = []  # tensors that must survive the run

    # -- building -----------------------------------------------------------------------------
    def tensor(self, name, shape, dtype="float32", gpu=0, kind=TensorKind.ACTIVATION) -> int:
        if not shape or any(int(s) < 1 for s in shape):
            raise InvalidShapeError(f"tensor {name!r} has shape {tuple(shape)}: every dimension must be at least 1")
        t = Tensor(len(self.tensors), name, tuple(int(s) for s in shape), dtype, gpu, kind)
        self.tensors.append(t)
        self.producer.append(-1)
        return t.id

    def add(self, name, op, inputs, outputs, *, gpu=0, params=None, views=None, flops=0.0) -> int:
        if op not in COMPUTE_OPS:
            raise InvalidGraphError(f"unknown op {op!r} (known: {', '.join(COMPUTE_OPS)})")
        for t in inputs:
            if self.tensors[t].kind is TensorKind.ACTIVATION and self.producer[t] < 0:
                raise InvalidGraphError(f"vertex {name!r} reads {self.tensors[t].name!r} before it is written")
        vid = len(self.vertices)
        for t in outputs:
            if self.producer[t] >= 0 or self.tensors[t].kind is not TensorKind.ACTIVATION:
                raise InvalidGraphError(f"tensor {self.tensors[t].name!r} written twice")
            self.producer[t] = vid
        if views is None:
            views = tuple(self.tensors[t].shape for t in (*inputs, *outputs))
        self.vertices.append(
            Vertex(vid, name, op, tuple(inputs), tuple(outputs), gpu, dict(params or {}), tuple(views), float(flops))
        )
        return vid

    # -- queries ------------------------------------------------------------------------------
    @property
    def n_gpus(self) -> int:
        return 1 + max((v.gpu for v in self.vertices), default=0)

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.kind is TensorKind.WEIGHT)

    def vertex_bytes(self, v: Vertex) -> int:
        """Bytes that must be resident on ``v``'s GPU while ``v`` runs."""
        return sum(self.tensors[t].nbytes for t in {*v.inputs, *v.outputs} if self.tensors[t].gpu == v.gpu)

    def edges(self) -> list[tuple[int, int]]:
        """Data edges producer -> consumer."""
        out = []
        for v in self.vertices:
            for t in dict.fromkeys(v.inputs):
                if self.producer[t] >= 0:
                    out.append((self.producer[t], v.id))
        return out

    def __repr__(self) -> str:
        return f"TaskGraph({len(self.vertices)} vertices, {len(self.tensors)} tensors, {self.n_gpus} GPU(s))"


# ---------------------------------------------------------------------------------------------
# LLaMA prefill
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA decoder stack (defaults: LLaMA-2-7B widths, 16 blocks, 1 x 2048 prefill)."""

    n_blocks: int = 16
    batch: int = 1
    seq: int = 2048
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 32  # = heads: multi-head attention; fewer: grouped-query attention
    ffn: int = 11008
    dtype: str = "float32"
    eps: float = 1e-6
    rope_theta: float = 10000.0
    head_size: int | None = None  # features per head, when not hidden / heads (a checkpoint's head_dim)
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections (frozen; the LoRA training graph only)

    def __post_init__(self) -> None:
        """Refuse shapes the graph cannot be built from (:class:`InvalidShapeError`, naming them)."""
        for name in ("n_blocks", "batch", "seq", "hidden", "heads", "kv_heads", "ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidShapeError(f"{name}={v!r}: must be a whole number of at least 1")
        if self.head_size is not None and (isinstance(self.head_size, bool) or not isinstance(self.head_size, int)
                                           or self.head_size < 1):
            raise InvalidShapeError(f"head_size={self.head_size!r}: must be a whole number of at least 1")
        if self.head_size is None and self.hidden % self.heads:
            raise InvalidShapeError(f"hidden={self.hidden} is not divisible by heads={self.heads}: every head "
                                    f"needs hidden / heads features")
        if self.head_dim % 2:
            raise InvalidShapeError(f"head_dim={self.head_dim} (hidden={self.hidden} / heads={self.heads}) is odd: "
                                    f"rotary embeddings rotate the two halves of each head")
        if self.heads % self.kv_heads:
            raise InvalidShapeError(f"kv_heads={self.kv_heads} does not divide heads={self.heads}: grouped-query "
                                    f"attention shares each key/value head among heads / kv_heads query heads")
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise InvalidShapeError(f"dtype={self.dtype!r} is not a numpy dtype") from None
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise InvalidShapeError(f"eps={self.eps!r}: must be a positive finite number")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    def block_weight_bytes(self) -> int:
        h, qd, kvd, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        n = 2 * qd * h + 2 * kvd * h + 3 * h * f + 2 * h
        return n * np.dtype(self.dtype).itemsize


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    if n % parts:
        raise InvalidShapeError(f"hidden={n} is not divisible into parts={parts}")
    s = n // parts
    return [(i * s, (i + 1) * s) for i in range(parts)]


def build_llama(cfg: LlamaConfig, parts: int = 1, n_gpus: int = 1) -> TaskGraph:
    """The prefill task graph of ``cfg.n_blocks`` decoder blocks.

    ``parts`` splits every GEMM along the rows of its weight and attention along heads
    (needs ``heads % parts == kv_heads % parts == ffn % parts == 0``). ``n_gpus`` places
    contiguous runs of blocks on each GPU (pipeline stages, blocks split as evenly as possible)
    and inserts a ``copy`` vertex where the hidden state crosses to the next GPU.

    Graph inputs: ``x`` (B*T, hidden). Graph output: the hidden state after the last block.
    Weight names: ``b{i}.attn_norm``, ``b{i}.wq.{p}``, ... (``.{p}`` is the part index).
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise InvalidShapeError(f"parts={parts!r}: must be a whole number of at least 1")
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise InvalidShapeError(f"n_gpus={n_gpus!r}: must be a whole number of at least 1")
    if cfg.heads % parts or cfg.kv_heads % parts or cfg.ffn % parts or cfg.heads % cfg.kv_heads:
        raise InvalidShapeError(f"parts={parts} must divide heads={cfg.heads}, kv_heads={cfg.kv_heads} and ffn={cfg.ffn}")
    if cfg.heads * cfg.head_dim != cfg.hidden:
        raise InvalidShapeError(f"head_size={cfg.head_size} x heads={cfg.heads} != hidden={cfg.hidden}: the prefill "
                                f"builder joins head parts into the hidden width (vmstoolkit.exec.model builds others)")
    g = TaskGraph()
    b, t, h, f, hd = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn, cfg.head_dim
    m = b * t
    nh_p, nkv_p = cfg.heads // parts, cfg.kv_heads // parts
    qd_p, kvd_p, f_p = nh_p * hd, nkv_p * hd, f // parts
    dt = cfg.dtype
    W = TensorKind.WEIGHT

    def gemm_flops(k, n):
        return 2.0 * m * k * n

    x = g.tensor("x", (m, h), dt, 0, TensorKind.INPUT)
    stage_of = [min(n_gpus - 1, i * n_gpus // cfg.n_blocks) for i in range(cfg.n_blocks)]
    for i in range(cfg.n_blocks):
        gpu = stage_of[i]
        p_ = f"b{i}."
        if g.tensors[x].gpu != gpu:
            xc = g.tensor(p_ + "x_in", (m, h), dt, gpu)
            g.add(p_ + "copy_in", "copy", [x], [xc], gpu=gpu)
            x = xc

        def T(name, shape, kind=TensorKind.ACTIVATION):
            return g.tensor(p_ + name, shape, dt, gpu, kind)

        def linear(name, xin, k, n, wname):
            w = T(wname, (n, k), W)
            y = T(name, (m, n))
            g.add(p_ + name, "linear", [xin, w], [y], gpu=gpu, flops=gemm_flops(k, n))
            return y

        def concat(name, pieces, width):
            y = T(name, (m, width))
            g.add(p_ + name, "concat", pieces, [y], gpu=gpu, flops=0.0)
            return y

        # attention half
        wn = T("attn_norm", (h,), W)
        xn = T("xn", (m, h))
        g.add(p_ + "attn_norm", "rmsnorm", [x, wn], [xn], gpu=gpu, params={"eps": cfg.eps}, flops=4.0 * m * h)
        att_parts = []
        for p in range(parts):
            q = linear(f"q.{p}", xn, h, qd_p, f"wq.{p}")
            k = linear(f"k.{p}", xn, h, kvd_p, f"wk.{p}")
            v = linear(f"v.{p}", xn, h, kvd_p, f"wv.{p}")
            qr, kr = T(f"qr.{p}", (m, qd_p)), T(f"kr.{p}", (m, kvd_p))
            rp = {"theta": cfg.rope_theta}
            g.add(p_ + f"rope_q.{p}", "rope", [q], [qr], gpu=gpu, params=rp,
                  views=((b, t, nh_p, hd), (b, t, nh_p, hd)), flops=3.0 * m * qd_p)
            g.add(p_ + f"rope_k.{p}", "rope", [k], [kr], gpu=gpu, params=rp,
                  views=((b, t, nkv_p, hd), (b, t, nkv_p, hd)), flops=3.0 * m * kvd_p)
            a = T(f"att.{p}", (m, qd_p))
            # causal: half of the T x T scores, QK^T and PV
            g.add(p_ + f"attention.{p}", "attention", [qr, kr, v], [a], gpu=gpu,
                  views=((b, t, nh_p, hd), (b, t, nkv_p, hd), (b, t, nkv_p, hd), (b, t, nh_p, hd)),
                  flops=2.0 * b * nh_p * t * t * hd)
            att_parts.append(a)
        att = att_parts[0] if parts == 1 else concat("att", att_parts, h)
        o_parts = [linear(f"o.{p}", att, h, hi - lo, f"wo.{p}") for p, (lo, hi) in enumerate(_split(h, parts))]
        o = o_parts[0] if parts == 1 else concat("o", o_parts, h)
        hs = T("h", (m, h))
        g.add(p_ + "attn_residual", "residual_add", [x, o], [hs], gpu=gpu, flops=1.0 * m * h)
        # FFN half
        wn2 = T("ffn_norm", (h,), W)
        hn = T("hn", (m, h))
        g.add(p_ + "ffn_norm", "rmsnorm", [hs, wn2], [hn], gpu=gpu, params={"eps": cfg.eps}, flops=4.0 * m * h)
        s_parts = []
        for p in range(parts):
            gt = linear(f"gate.{p}", hn, h, f_p, f"wg.{p}")
            up = linear(f"up.{p}", hn, h, f_p, f"wu.{p}")
            s = T(f"s.{p}", (m, f_p))
            g.add(p_ + f"swiglu.{p}", "swiglu", [gt, up], [s], gpu=gpu, flops=5.0 * m * f_p)
            s_parts.append(s)
        s = s_parts[0] if parts == 1 else concat("s", s_parts, f)
        d_parts = [linear(f"down.{p}", s, f, hi - lo, f"wd.{p}") for p, (lo, hi) in enumerate(_split(h, parts))]
        d = d_parts[0] if parts == 1 else concat("down", d_parts, h)
        out = T("out", (m, h))
        g.add(p_ + "ffn_residual", "residual_add", [hs, d], [out], gpu=gpu, flops=1.0 * m * h)
        x = out
    g.outputs = [x]
    return g


def random_weights(graph: TaskGraph, seed: int = 0, scale: float | None = None) -> dict[int, np.ndarray]:
    """Host arrays for every weight and input of ``graph``: norms near 1, linear weights
    ~ N(0, 1/in_features) so activations stay O(1) through many blocks."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in graph.tensors:
        if t.kind is TensorKind.ACTIVATION:
            continue
        if t.kind is TensorKind.WEIGHT and len(t.shape) == 1:
            a = 1.0 + 0.1 * rng.standard_normal(t.shape)
        elif t.kind is TensorKind.WEIGHT:
            a = rng.standard_normal(t.shape) * (scale if scale is not None else 1.0 / math.sqrt(t.shape[1]))
        else:
            a = rng.standard_normal(t.shape)
        out[t.id] = a.astype(t.dtype)
    return out
