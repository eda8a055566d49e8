"""Training task graphs: forward, backward and AdamW step of a stack of LLaMA blocks.

``build_train_step(config, variant)`` returns a :class:`TrainGraph`: a :class:`TaskGraph` whose
vertices are the forward of every block (saving what backward needs), the backward from the last
block to the first, and an AdamW update of each trainable tensor right after its gradient is
complete. Nothing is special about training for the compiler: saved activations, weights,
gradients and Adam moments are tensors like any other, so the memory-graph compiler decides for
each whether it stays on the GPU or goes to host memory and comes back.

Variants:

- ``"full"``: every weight (projections and norms) is trainable: weights, gradients and the
  Adam moments ``m``, ``v`` are all state (the moments start on the host as inputs, the updated
  weights and moments are graph outputs);
- ``"lora"``: the fp32 base weights are frozen; each of the seven projections ``q, k, v, o,
  gate, up, down`` gets adapters ``A`` (r, in) and ``B`` (out, r): ``y = x W^T + (x A^T) B^T``
  (the usual ``alpha / r`` scale folded into B). Only A and B are trained.

Losses (``loss=``):

- ``"dot"`` (the default, what ``experiment train-offload`` times): ``<out, dout>`` for a given
  ``dout`` (graph input ``dout``), the gradient that a head and a loss would hand to the last
  block;
- ``"lm"``: the causal-LM loss of ``transformers``' ``LlamaForCausalLM`` (``loss`` with
  ``labels=input_ids``): the final RMSNorm (weight ``norm``), the LM head (``lm_head`` (V, H),
  the embedding table for tied checkpoints), softmax cross-entropy against ``labels`` (graph
  input (M,) int32: the next token's id on every row, negative on each sequence's last row,
  which has none), averaged over the labelled rows. The final norm and the head are frozen
  (no gradient, no update: as in LoRA, and in full fine-tuning too, where only the blocks are
  trained); their backward (``cross_entropy``'s dlogits, ``linear_dx`` through the head,
  ``rmsnorm_dx``) hands the last block its ``dout``. The graph output ``loss_rows`` (M,) sums
  to the loss (:func:`lm_loss`).

Tensors are write-once, so every update writes new
tensors (``{param}.new``, ``{param}.adam_m.new``, ``{param}.adam_v.new``).

Saved for backward, per block (B*T = M rows): the block input x, the normed inputs of both
halves, q and k after RoPE, v, the attention output and its row statistics ``lse`` (B, nh, T),
the residual h, gate and up, silu(gate) * up, and with LoRA each adapter's (M, r) product.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vmstoolkit.exec.errors import InvalidOptionError, InvalidShapeError
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, TensorKind

VARIANTS = ("lora", "full")
LOSSES = ("dot", "lm")
PROJECTIONS = ("wq", "wk", "wv", "wo", "wg", "wu", "wd")


@dataclass(frozen=True)
class AdamWConfig:
    """``torch.optim.AdamW`` hyper-parameters (its defaults, but a fine-tuning learning rate)."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    step: int = 1  # the step being taken, from 1 (bias correction)

    def params(self) -> dict:
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "step": self.step}


@dataclass
class TrainGraph:
    """A training step's task graph and where its parameters, gradients and updates are."""

    graph: TaskGraph
    config: LlamaConfig
    variant: str
    rank: int
    adamw: AdamWConfig
    x: int  # input tensor (M, H)
    dout: int  # gradient of the loss with respect to the last block's output (M, H); -1 with loss="lm"
    params: dict[str, int] = field(default_factory=dict)  # trainable name -> tensor
    grads: dict[str, int] = field(default_factory=dict)  # trainable name -> its gradient
    moments: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (m, v) before
    updates: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> (w, m, v) after
    loss: str = "dot"  # LOSSES
    labels: int = -1  # loss="lm": input (M,) int32, the next token's id per row (negative: none)
    loss_rows: int = -1  # loss="lm": output (M,), each row's share of the mean loss

    def trainable_bytes(self) -> int:
        return sum(self.graph.tensors[t].nbytes for t in self.params.values())


def build_train_step(cfg: LlamaConfig, variant: str = "lora", *, rank: int = 16,
                     adamw: AdamWConfig | None = None, keep_grads: bool = False, loss: str = "dot",
                     vocab: int | None = None) -> TrainGraph:
    """The task graph of one training step of ``cfg.n_blocks`` blocks (module docstring).

    ``loss``: ``"dot"`` or ``"lm"`` (with ``vocab``, the LM head's rows). ``keep_grads`` also
    makes every gradient a graph output (for tests; it keeps them alive).
    """
    from vmstoolkit.kernels.tasks import KERNEL_TASKS

    if variant not in VARIANTS:
        raise InvalidOptionError(f"unknown variant {variant!r} (choose one of {', '.join(VARIANTS)})")
    if cfg.heads % cfg.kv_heads or (cfg.head_size is None and cfg.hidden % cfg.heads) or cfg.head_dim % 2:
        raise InvalidShapeError(f"heads={cfg.heads}, kv_heads={cfg.kv_heads}, hidden={cfg.hidden}: need heads % kv_heads "
                         f"== 0 and an even head_dim (hidden / heads unless head_size is given)")
    if cfg.qkv_bias and variant != "lora":
        raise InvalidOptionError("qkv_bias: the full fine-tuning graph trains no biases; the biases are frozen in "
                                 "the LoRA graph only")
    if variant == "lora" and rank <= 0:
        raise InvalidShapeError(f"LoRA rank must be positive, got {rank}")
    if loss not in LOSSES:
        raise InvalidOptionError(f"unknown loss {loss!r} (choose one of {', '.join(LOSSES)})")
    if loss == "lm" and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise InvalidShapeError(f"loss='lm' needs the vocabulary size: vocab={vocab!r}")
    opt = adamw or AdamWConfig()
    lora = variant == "lora"
    g = TaskGraph()
    b, t, h, f, hd = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn, cfg.head_dim
    nh, nkv = cfg.heads, cfg.kv_heads
    m = b * t
    qd, kvd = nh * hd, nkv * hd
    dt = cfg.dtype
    W = TensorKind.WEIGHT
    x = g.tensor("x", (m, h), dt, 0, TensorKind.INPUT)
    dout = g.tensor("dout", (m, h), dt, 0, TensorKind.INPUT) if loss == "dot" else -1
    tg = TrainGraph(g, cfg, variant, rank, opt, x, dout, loss=loss)
    if loss == "lm":
        tg.labels = g.tensor("labels", (m,), "int32", 0, TensorKind.INPUT)
    eps, theta = {"eps": cfg.eps}, {"theta": cfg.rope_theta}
    q4, kv4 = (b, t, nh, hd), (b, t, nkv, hd)

    def op(name, kind, inputs, outputs, params=None, views=None):
        shapes = views[: len(inputs)] if views else [g.tensors[i].shape for i in inputs]
        return g.add(name, kind, inputs, outputs, params=params, views=views,
                     flops=KERNEL_TASKS[kind].flops(list(shapes), **(params or {})))

    def act(name, shape):
        return g.tensor(name, shape, dt)

    def trainable(name, shape):
        p = g.tensor(name, shape, dt, 0, W)
        tg.params[name] = p
        tg.moments[name] = (g.tensor(name + ".adam_m", shape, dt, 0, W), g.tensor(name + ".adam_v", shape, dt, 0, W))
        return p

    def step(name, grad):
        """Mark ``grad`` as the gradient of ``name`` and update it right away."""
        tg.grads[name] = grad
        shape = g.tensors[grad].shape
        outs = [act(name + ".new", shape), act(name + ".adam_m.new", shape), act(name + ".adam_v.new", shape)]
        mm, vv = tg.moments[name]
        op(name + ".adamw", "adamw", [tg.params[name], grad, mm, vv], outs, params=opt.params())
        tg.updates[name] = tuple(outs)

    saved: list[dict] = []

    # -- forward ---------------------------------------------------------------------------
    for i in range(cfg.n_blocks):
        p = f"b{i}."
        s: dict = {"x": x}

        def linear(wname, xin, k_in, n_out, s=s, p=p):
            w = g.tensor(p + wname, (n_out, k_in), dt, 0, W)
            if not lora:
                tg.params[p + wname] = w
                tg.moments[p + wname] = (g.tensor(p + wname + ".adam_m", (n_out, k_in), dt, 0, W),
                                         g.tensor(p + wname + ".adam_v", (n_out, k_in), dt, 0, W))
            y = act(p + wname.lstrip("w"), (m, n_out))
            op(p + wname[1:], "linear", [xin, w], [y])
            s[wname] = (w, xin)
            if cfg.qkv_bias and wname in ("wq", "wk", "wv"):  # frozen: dx passes through a bias unchanged
                bias = g.tensor(p + wname + ".bias", (n_out,), dt, 0, W)
                yb = act(p + wname.lstrip("w") + "+bias", (m, n_out))
                op(p + wname[1:] + ".bias", "bias_add", [y, bias], [yb])
                y = yb
            if lora:
                la = trainable(p + wname + ".lora_a", (rank, k_in))
                lb = trainable(p + wname + ".lora_b", (n_out, rank))
                u = act(p + wname + ".lora_u", (m, rank))
                op(p + wname + ".lora_a", "linear", [xin, la], [u])
                ly = act(p + wname + ".lora_y", (m, n_out))
                op(p + wname + ".lora_b", "linear", [u, lb], [ly])
                y2 = act(p + wname.lstrip("w") + "+lora", (m, n_out))
                op(p + wname + ".lora_add", "residual_add", [y, ly], [y2])
                s[wname + ".lora"] = (la, lb, u)
                y = y2
            return y

        def norm(name, xin, s=s, p=p):
            w = g.tensor(p + name, (h,), dt, 0, W)
            if not lora:
                tg.params[p + name] = w
                tg.moments[p + name] = (g.tensor(p + name + ".adam_m", (h,), dt, 0, W),
                                        g.tensor(p + name + ".adam_v", (h,), dt, 0, W))
            y = act(p + name.replace("norm", "n"), (m, h))
            op(p + name, "rmsnorm", [xin, w], [y], params=eps)
            s[name] = w
            return y

        xn = norm("attn_norm", x)
        q = linear("wq", xn, h, qd)
        k = linear("wk", xn, h, kvd)
        v = linear("wv", xn, h, kvd)
        qr, kr = act(p + "qr", (m, qd)), act(p + "kr", (m, kvd))
        op(p + "rope_q", "rope", [q], [qr], params=theta, views=(q4, q4))
        op(p + "rope_k", "rope", [k], [kr], params=theta, views=(kv4, kv4))
        a, lse = act(p + "att", (m, qd)), act(p + "lse", (b, nh, t))
        op(p + "attention", "attention_lse", [qr, kr, v], [a, lse], views=(q4, kv4, kv4, q4, (b, nh, t)))
        o = linear("wo", a, qd, h)
        hs = act(p + "h", (m, h))
        op(p + "attn_residual", "residual_add", [x, o], [hs])
        hn = norm("ffn_norm", hs)
        gt = linear("wg", hn, h, f)
        up = linear("wu", hn, h, f)
        sw = act(p + "s", (m, f))
        op(p + "swiglu", "swiglu", [gt, up], [sw])
        d = linear("wd", sw, f, h)
        out = act(p + "out", (m, h))
        op(p + "ffn_residual", "residual_add", [hs, d], [out])
        s.update(qr=qr, kr=kr, v=v, a=a, lse=lse, h=hs, g=gt, u=up)
        saved.append(s)
        x = out

    # -- the causal-LM loss and its gradient up to the last block: frozen norm and head ------
    dy = dout
    if loss == "lm":
        norm_w = g.tensor("norm", (h,), dt, 0, W)
        head = g.tensor("lm_head", (vocab, h), dt, 0, W)
        xf = act("final.xn", (m, h))
        op("final_norm", "rmsnorm", [x, norm_w], [xf], params=eps)
        logits = act("logits", (m, vocab))
        op("lm_head", "linear", [xf, head], [logits])
        tg.loss_rows = act("loss_rows", (m,))
        dlogits = act("dlogits", (m, vocab))
        op("cross_entropy", "cross_entropy", [logits, tg.labels], [tg.loss_rows, dlogits])
        dxf = act("final.dxn", (m, h))
        op("lm_head.dx", "linear_dx", [dlogits, head], [dxf])
        dy = act("final.dx", (m, h))
        op("final_norm.dx", "rmsnorm_dx", [x, norm_w, dxf], [dy], params=eps)

    # -- backward and updates, last block first ----------------------------------------------
    for i in reversed(range(cfg.n_blocks)):
        p = f"b{i}."
        s = saved[i]

        def linear_back(wname, dyl, want_dx=True, s=s, p=p):
            """Gradients of one projection given ``dyl`` (M, out); returns the pieces of dx, to be
            chained through the accumulator by the caller (list of (dy, w) pairs)."""
            w, xin = s[wname]
            pieces = [(dyl, w)]
            if lora:
                la, lb, u = s[wname + ".lora"]
                db = act(p + wname + ".lora_b.grad", g.tensors[lb].shape)
                op(p + wname + ".lora_b.dw", "linear_dw", [dyl, u], [db])
                step(p + wname + ".lora_b", db)
                du = act(p + wname + ".lora_du", (m, rank))
                op(p + wname + ".lora_b.dx", "linear_dx", [dyl, lb], [du])
                da = act(p + wname + ".lora_a.grad", g.tensors[la].shape)
                op(p + wname + ".lora_a.dw", "linear_dw", [du, xin], [da])
                step(p + wname + ".lora_a", da)
                pieces.append((du, la))
            else:
                dw = act(p + wname + ".grad", g.tensors[w].shape)
                op(p + wname + ".dw", "linear_dw", [dyl, xin], [dw])
                step(p + wname, dw)
            return pieces

        def dx_sum(name, pieces, k_in):
            """dx = sum of dy_j @ w_j, chained through the GEMM's accumulator."""
            acc = None
            for j, (dyl, w) in enumerate(pieces):
                y = act(f"{name}.{j}" if j < len(pieces) - 1 else name, (m, k_in))
                op(f"{name}.dx{j}", "linear_dx", [dyl, w] + ([acc] if acc is not None else []), [y])
                acc = y
            return acc

        def norm_back(name, xin, dyn, p=p, s=s):
            dxn = act(p + name + ".dx", (m, h))
            op(p + name + ".dx", "rmsnorm_dx", [xin, s[name], dyn], [dxn], params=eps)
            if not lora:
                dw = act(p + name + ".grad", (h,))
                op(p + name + ".dw", "rmsnorm_dw", [xin, dyn], [dw], params=eps)
                step(p + name, dw)
            return dxn

        # FFN half: out = h + down(swiglu(gate(hn), up(hn)))
        dsw = dx_sum(p + "ds", linear_back("wd", dy), f)
        dgt, dup = act(p + "dgate", (m, f)), act(p + "dup", (m, f))
        op(p + "swiglu.back", "swiglu_backward", [s["g"], s["u"], dsw], [dgt, dup])
        dhn = dx_sum(p + "dhn", linear_back("wg", dgt) + linear_back("wu", dup), h)
        dhs_n = norm_back("ffn_norm", s["h"], dhn)
        dhs = act(p + "dh", (m, h))
        op(p + "dh", "residual_add", [dy, dhs_n], [dhs])
        # attention half: h = x + o(attention(rope(q(xn)), rope(k(xn)), v(xn)))
        da = dx_sum(p + "da", linear_back("wo", dhs), qd)
        dqr, dkr, dv = act(p + "dqr", (m, qd)), act(p + "dkr", (m, kvd)), act(p + "dv", (m, kvd))
        op(p + "attention.back", "attention_backward", [s["qr"], s["kr"], s["v"], s["a"], s["lse"], da],
           [dqr, dkr, dv], views=(q4, kv4, kv4, q4, (b, nh, t), q4, q4, kv4, kv4))
        dq, dk = act(p + "dq", (m, qd)), act(p + "dk", (m, kvd))
        op(p + "rope_q.back", "rope_backward", [dqr], [dq], params=theta, views=(q4, q4))
        op(p + "rope_k.back", "rope_backward", [dkr], [dk], params=theta, views=(kv4, kv4))
        dxn = dx_sum(p + "dxn", linear_back("wq", dq) + linear_back("wk", dk) + linear_back("wv", dv), h)
        dx_n = norm_back("attn_norm", s["x"], dxn)
        dx = act(p + "dx", (m, h))
        op(p + "dx", "residual_add", [dhs, dx_n], [dx])
        dy = dx

    outs = []
    for name in tg.updates:
        outs.extend(tg.updates[name])
    if keep_grads:
        outs.extend(tg.grads.values())
    if loss == "lm":
        outs.append(tg.loss_rows)
    g.outputs = outs
    return tg


def lm_labels(ids, batch: int = 1) -> np.ndarray:
    """The ``labels`` input of a ``loss="lm"`` step over token ``ids`` (``batch`` sequences of
    equal length, concatenated): each row's next token within its sequence, -1 on each last
    row (transformers shifts ``labels=input_ids`` the same way)."""
    a = np.asarray(ids, np.int64).reshape(batch, -1)
    out = np.full(a.shape, -1, np.int32)
    out[:, :-1] = a[:, 1:]
    return out.reshape(-1)


def lm_loss(tg: TrainGraph, outputs: dict[int, np.ndarray]) -> float:
    """The mean cross-entropy of a ``loss="lm"`` step from its ``loss_rows`` output (float64 sum)."""
    if tg.loss != "lm":
        raise InvalidOptionError(f"this training graph's loss is {tg.loss!r}, not 'lm'")
    return float(np.sum(outputs[tg.loss_rows], dtype=np.float64))


def random_train_values(tg: TrainGraph, seed: int = 0, lora_b_scale: float = 0.1,
                        threads: int | None = None) -> dict[int, np.ndarray]:
    """Host values of every weight and input: projections ~ N(0, 1/in), norms near 1, LoRA A
    ~ N(0, 1/in) and B ~ N(0, lora_b_scale^2 / r) (non-zero, so that A gets a gradient too;
    real LoRA starts B at 0), Adam moments at zero, x and dout ~ N(0, 1), ``labels`` (loss
    ``"lm"``) uniform token ids shifted as :func:`lm_labels`.

    Each tensor draws from its own generator (``SeedSequence(seed)`` spawned once per tensor, in
    tensor order), so the values depend on ``seed`` alone, not on ``threads``: the tensors are
    drawn by ``threads`` worker threads (default: every CPU; numpy releases the GIL while it
    fills an array). Drawing was the H200 host's largest cost after JIT (41 s for the 13 GB of
    Mistral-7B-wide base weights, one thread: ``experiments/results/untuned-shapes/h200-run1``);
    the CPU time is the same, the wall time divided by the cores."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    todo = [t for t in tg.graph.tensors if t.kind is not TensorKind.ACTIVATION]
    seeds = np.random.SeedSequence(seed).spawn(len(todo))

    def draw(t, ss) -> np.ndarray:
        dt = np.dtype(t.dtype)
        rng = np.random.default_rng(ss)
        # Drawn in the tensor's own dtype when numpy can (float32: 6x faster than drawing float64
        # and converting, which took minutes for LLaMA-7B-wide weights on the H200's host).
        draw_dt = dt if dt in (np.float32, np.float64) else np.float64

        def normal(scale=1.0, shift=0.0):
            a = rng.standard_normal(t.shape, dtype=draw_dt)
            if scale != 1.0:
                a *= draw_dt.type(scale)
            if shift:
                a += draw_dt.type(shift)
            return a

        if t.name.endswith((".adam_m", ".adam_v")):
            a = np.zeros(t.shape, dt)
        elif t.id == tg.labels:  # loss="lm": token ids of the head's vocabulary, shifted
            vocab = tg.graph.tensors[tg.graph.vertices[tg.graph.producer[tg.loss_rows]].inputs[0]].shape[1]
            a = lm_labels(rng.integers(0, vocab, t.shape[0]), tg.config.batch)
        elif t.kind is TensorKind.INPUT:
            a = normal()
        elif len(t.shape) == 1:
            a = normal(0.1, 1.0)
        elif t.name.endswith(".lora_b"):
            a = normal(lora_b_scale / np.sqrt(t.shape[1]))
        else:
            a = normal(1.0 / np.sqrt(t.shape[1]))
        return a.astype(dt, copy=False)

    n = threads or os.cpu_count() or 1
    if n <= 1:
        arrays = [draw(t, ss) for t, ss in zip(todo, seeds)]
    else:
        with ThreadPoolExecutor(n) as pool:
            arrays = list(pool.map(draw, todo, seeds))
    return {t.id: a for t, a in zip(todo, arrays)}


def gradient_sources(tg: TrainGraph) -> list[int]:
    """The output tensors :func:`grads_from_updates` reads (each trainable's updated first moment):
    what a check of the gradients needs back from a run, a third of the updated state."""
    return [m_new for _, m_new, _ in tg.updates.values()]


def grads_from_updates(tg: TrainGraph, values: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Each trainable tensor's gradient, read back from the updated first moment:
    ``m' = beta1 m + (1 - beta1) g``, so ``g = (m' - beta1 m) / (1 - beta1)``, computed in float64
    one tensor at a time and returned in the moment's dtype (exact for m = 0 up to two roundings).
    Lets a run check gradients without keeping them alive; ``outputs`` needs only
    :func:`gradient_sources`."""
    b1 = tg.adamw.beta1
    out = {}
    for name, (_, m_new, _) in tg.updates.items():
        m_old = values[tg.moments[name][0]].astype(np.float64)
        g = (outputs[m_new].astype(np.float64) - b1 * m_old) / (1.0 - b1)
        out[name] = g.astype(outputs[m_new].dtype, copy=False)
    return out
