"""The whole model's task graph for generation: embedding, blocks, final norm and LM head, for
the prefill and then every greedy decoding step, unrolled into one graph.

One graph, so that one memory plan covers the run: the weights, every activation and the KV
cache are tensors like any other, which the compiler keeps on the GPU or offloads to the host
and brings back (FlexGen's choice, made by the planner rather than by hand). Tensors are
write-once, so the cache of block ``i`` grows by a copy: after step ``s`` it is a new tensor
``append_rows(cache, k_new)`` and the old one dies (the copy costs one read and write of the
cache per step and block, bandwidth-bound, and is counted in the FLOP-free cost of the vertex).
The greedy choice is on the GPU too (``argmax``), and the next step's embedding reads that token
id: no host round trip between steps.

Layout per step ``tag`` (``prefill``, ``d1``, ``d2``, ...): ``{tag}.x`` the embedded tokens,
``{tag}.b{i}.*`` the block's activations, ``{tag}.b{i}.kcache`` / ``.vcache`` the cache after the
step, ``{tag}.logits`` and ``{tag}.token``. Weight tensors carry their Hugging Face names. With
``n_gpus > 1`` the blocks are split into contiguous pipeline stages (as
:func:`vmstoolkit.exec.graph.build_llama` does); the embedding is on GPU 0, the head on the last
GPU, with ``copy`` vertices where the hidden state or the token id crosses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vmstoolkit.exec.errors import InvalidShapeError
from vmstoolkit.exec.graph import TaskGraph, TensorKind
from vmstoolkit.exec.model.checkpoint import hf_names
from vmstoolkit.exec.model.config import ModelConfig

LOGITS = ("last", "all")


@dataclass
class GenerateGraph:
    """A generation's task graph and where its pieces are."""

    graph: TaskGraph
    config: ModelConfig
    prompt_len: int
    new_tokens: int
    prompt: int  # input tensor: the prompt's token ids (T,) int32
    logits: int  # output: the prefill's logits, (1, vocab) or with logits="all" (T, vocab)
    tokens: list[int] = field(default_factory=list)  # outputs: each generated token (1,) int32
    weights: dict[int, str] = field(default_factory=dict)  # weight tensor -> Hugging Face name
    first_token_vertex: int = -1  # the prefill's argmax: the end of the prefill


def _check(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidShapeError(f"{name}={v!r}: must be a whole number of at least {lo}")
    return v


def build_generate(cfg: ModelConfig, prompt_len: int, new_tokens: int, *, logits: str = "last",
                   n_gpus: int = 1) -> GenerateGraph:
    """The graph of a prefill of ``prompt_len`` tokens and ``new_tokens - 1`` decoding steps
    (the prefill yields the first new token). ``logits``: ``"last"`` (the prefill's last row,
    what generation needs) or ``"all"`` (every prompt position, to compare with transformers)."""
    from vmstoolkit.kernels.tasks import KERNEL_TASKS

    _check("prompt_len", prompt_len)
    _check("new_tokens", new_tokens)
    _check("n_gpus", n_gpus)
    if logits not in LOGITS:
        raise InvalidShapeError(f"logits={logits!r}: choose one of {', '.join(LOGITS)}")
    if n_gpus > cfg.n_blocks:
        raise InvalidShapeError(f"n_gpus={n_gpus} is more than the model's {cfg.n_blocks} blocks")
    cfg.check_positions(prompt_len + new_tokens - 1)
    g = TaskGraph()
    shapes = hf_names(cfg)
    h, hd, nh, nkv, v_ = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.vocab
    stage = [min(n_gpus - 1, i * n_gpus // cfg.n_blocks) for i in range(cfg.n_blocks)]
    last_gpu = n_gpus - 1
    wid: dict[tuple[str, int], int] = {}
    gg = GenerateGraph(g, cfg, prompt_len, new_tokens, prompt=-1, logits=-1)

    def weight(name: str, gpu: int, shape_of: str | None = None) -> int:
        key = (name, gpu)
        if key not in wid:
            t = g.tensor(name if gpu == 0 else f"{name}@gpu{gpu}", shapes[shape_of or name], "float32", gpu,
                         TensorKind.WEIGHT)
            wid[key] = t
            gg.weights[t] = name
        return wid[key]

    def op(name, kind, inputs, outputs, gpu, params=None, views=None):
        vs = views[: len(inputs)] if views else [g.tensors[i].shape for i in inputs]
        return g.add(name, kind, inputs, outputs, gpu=gpu, params=params, views=views,
                     flops=KERNEL_TASKS[kind].flops(list(vs), **(params or {})))

    def act(name, shape, gpu, dtype="float32"):
        return g.tensor(name, shape, dtype, gpu)

    def move(t, gpu, name):
        """``t`` on ``gpu`` (a copy vertex when it is elsewhere)."""
        src = g.tensors[t]
        if src.gpu == gpu:
            return t
        c = act(name, src.shape, gpu, src.dtype)
        g.add(name, "copy", [t], [c], gpu=gpu)
        return c

    def forward(ids: int, rows: int, pos0: int, caches, tag: str):
        x = act(f"{tag}.x", (rows, h), 0)
        op(f"{tag}.embed", "embedding", [ids, weight("model.embed_tokens.weight", 0)], [x], 0)
        new_caches = []
        q4, kv4 = (1, rows, nh, hd), (1, rows, nkv, hd)
        rope = {"theta": cfg.rope_theta, "offset": pos0}
        for i in range(cfg.n_blocks):
            gpu, p, hp = stage[i], f"{tag}.b{i}.", f"model.layers.{i}."
            x = move(x, gpu, p + "x_in")

            def linear(name, xin, wname, n_out, bias=False, p=p, hp=hp, gpu=gpu):
                y = act(p + name, (rows, n_out), gpu)
                op(p + name, "linear", [xin, weight(hp + wname + ".weight", gpu)], [y], gpu)
                if bias:
                    yb = act(p + name + "+bias", (rows, n_out), gpu)
                    op(p + name + ".bias", "bias_add", [y, weight(hp + wname + ".bias", gpu)], [yb], gpu)
                    y = yb
                return y

            def norm(name, xin, wname, p=p, hp=hp, gpu=gpu):
                y = act(p + name, (rows, h), gpu)
                op(p + name, "rmsnorm", [xin, weight(hp + wname + ".weight", gpu)], [y], gpu, {"eps": cfg.eps})
                return y

            xn = norm("xn", x, "input_layernorm")
            q = linear("q", xn, "self_attn.q_proj", cfg.q_dim, cfg.qkv_bias)
            k = linear("k", xn, "self_attn.k_proj", cfg.kv_dim, cfg.qkv_bias)
            v = linear("v", xn, "self_attn.v_proj", cfg.kv_dim, cfg.qkv_bias)
            qr, kr = act(p + "qr", (rows, cfg.q_dim), gpu), act(p + "kr", (rows, cfg.kv_dim), gpu)
            op(p + "rope_q", "rope", [q], [qr], gpu, rope, views=(q4, q4))
            op(p + "rope_k", "rope", [k], [kr], gpu, rope, views=(kv4, kv4))
            a = act(p + "att", (rows, cfg.q_dim), gpu)
            if caches is None:  # the prefill: the cache is this step's keys and values
                kc, vc = kr, v
                op(p + "attention", "attention", [qr, kr, v], [a], gpu, views=(q4, kv4, kv4, q4))
            else:
                tk = pos0 + rows
                kc, vc = act(p + "kcache", (tk, cfg.kv_dim), gpu), act(p + "vcache", (tk, cfg.kv_dim), gpu)
                op(p + "kcache", "append_rows", [caches[i][0], kr], [kc], gpu)
                op(p + "vcache", "append_rows", [caches[i][1], v], [vc], gpu)
                c4 = (1, tk, nkv, hd)
                op(p + "attention", "attention_cached", [qr, kc, vc], [a], gpu, views=(q4, c4, c4, q4))
            new_caches.append((kc, vc))
            o = linear("o", a, "self_attn.o_proj", h)
            hs = act(p + "h", (rows, h), gpu)
            op(p + "attn_residual", "residual_add", [x, o], [hs], gpu)
            hn = norm("hn", hs, "post_attention_layernorm")
            gt = linear("gate", hn, "mlp.gate_proj", cfg.ffn)
            up = linear("up", hn, "mlp.up_proj", cfg.ffn)
            s = act(p + "s", (rows, cfg.ffn), gpu)
            op(p + "swiglu", "swiglu", [gt, up], [s], gpu)
            d = linear("down", s, "mlp.down_proj", h)
            out = act(p + "out", (rows, h), gpu)
            op(p + "ffn_residual", "residual_add", [hs, d], [out], gpu)
            x = out
        x = move(x, last_gpu, f"{tag}.head_in")
        return x, new_caches

    def head(x, rows, tag, all_rows: bool):
        gpu = last_gpu
        if not all_rows and rows > 1:
            xl = act(f"{tag}.last", (1, h), gpu)
            op(f"{tag}.last", "take_rows", [x], [xl], gpu, {"lo": rows - 1, "hi": rows})
            x, rows = xl, 1
        xn = act(f"{tag}.norm", (rows, h), gpu)
        op(f"{tag}.norm", "rmsnorm", [x, weight("model.norm.weight", gpu)], [xn], gpu, {"eps": cfg.eps})
        w = (weight("model.embed_tokens.weight", gpu) if cfg.tied else weight("lm_head.weight", gpu))
        lg = act(f"{tag}.logits", (rows, v_), gpu)
        op(f"{tag}.lm_head", "linear", [xn, w], [lg], gpu)
        last = lg
        if rows > 1:
            last = act(f"{tag}.logits_last", (1, v_), gpu)
            op(f"{tag}.logits_last", "take_rows", [lg], [last], gpu, {"lo": rows - 1, "hi": rows})
        tok = act(f"{tag}.token", (1,), gpu, "int32")
        vid = op(f"{tag}.argmax", "argmax", [last], [tok], gpu)
        return lg, tok, vid

    gg.prompt = g.tensor("prompt_ids", (prompt_len,), "int32", 0, TensorKind.INPUT)
    x, caches = forward(gg.prompt, prompt_len, 0, None, "prefill")
    gg.logits, tok, gg.first_token_vertex = head(x, prompt_len, "prefill", logits == "all")
    gg.tokens.append(tok)
    for s in range(1, new_tokens):
        tag = f"d{s}"
        ids = move(tok, 0, f"{tag}.ids")
        x, caches = forward(ids, 1, prompt_len + s - 1, caches, tag)
        _, tok, _ = head(x, 1, tag, False)
        gg.tokens.append(tok)
    g.outputs = [gg.logits, *gg.tokens]
    return gg
