"""A training step of the LLaMA stack written directly in numpy (float64): the ground truth for
the training graphs' gradients and updates, independent of the graph builder.

It calls the references of ``vmstoolkit.kernels.reference`` (each checked against finite
differences in ``tests/kernels/test_reference_backward.py``) in a plain loop over blocks, by
parameter name, with no task graph; ``tests/exec/test_train_graph.py`` also checks it against
finite differences of the whole loss.
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.kernels import reference as R

PROJ_IN = {"wq": "xn", "wk": "xn", "wv": "xn", "wo": "a", "wg": "hn", "wu": "hn", "wd": "s"}


def _proj(wt, name, xin, lora):
    y = R.linear(xin, wt[name])
    if name + ".bias" in wt:  # Qwen2's q/k/v biases (frozen)
        y = y + wt[name + ".bias"]
    if lora:
        u = R.linear(xin, wt[name + ".lora_a"])
        y = y + R.linear(u, wt[name + ".lora_b"])
    return y


def block_forward(wt: dict, p: str, x, cfg, lora: bool):
    """One block on x (M, H); returns (out, cache of what backward needs)."""
    b, t, nh, nkv, hd = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    w = {k[len(p):]: v for k, v in wt.items() if k.startswith(p)}
    c = {"x": x}
    c["xn"] = R.rmsnorm(x, w["attn_norm"], cfg.eps)
    q = _proj(w, "wq", c["xn"], lora).reshape(b, t, nh, hd)
    k = _proj(w, "wk", c["xn"], lora).reshape(b, t, nkv, hd)
    c["v"] = _proj(w, "wv", c["xn"], lora).reshape(b, t, nkv, hd)
    c["qr"], c["kr"] = R.rope(q, cfg.rope_theta), R.rope(k, cfg.rope_theta)
    att, c["lse"] = R.attention_lse(c["qr"], c["kr"], c["v"])
    c["att4"] = att
    c["a"] = att.reshape(b * t, nh * hd)
    c["h"] = x + _proj(w, "wo", c["a"], lora)
    c["hn"] = R.rmsnorm(c["h"], w["ffn_norm"], cfg.eps)
    c["g"], c["u"] = _proj(w, "wg", c["hn"], lora), _proj(w, "wu", c["hn"], lora)
    c["s"] = R.swiglu(c["g"], c["u"])
    return c["h"] + _proj(w, "wd", c["s"], lora), c


def block_backward(wt: dict, p: str, c: dict, dy, cfg, lora: bool, grads: dict):
    """Gradients of one block given dy (M, H): fills ``grads`` by parameter name, returns dx."""
    b, t, nh, nkv, hd = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    m = b * t

    def proj_back(name, dyl):
        xin = c[PROJ_IN[name]]
        dx = R.linear_backward_x(dyl, wt[p + name])
        if lora:
            u = R.linear(xin, wt[p + name + ".lora_a"])
            grads[p + name + ".lora_b"] = R.linear_backward_w(dyl, u)
            du = R.linear_backward_x(dyl, wt[p + name + ".lora_b"])
            grads[p + name + ".lora_a"] = R.linear_backward_w(du, xin)
            dx = dx + R.linear_backward_x(du, wt[p + name + ".lora_a"])
        else:
            grads[p + name] = R.linear_backward_w(dyl, xin)
        return dx

    def norm_back(name, xin, dyn):
        dx, dw = R.rmsnorm_backward(xin, wt[p + name], dyn, cfg.eps)
        if not lora:
            grads[p + name] = dw
        return dx

    ds = proj_back("wd", dy)
    dg, du = R.swiglu_backward(c["g"], c["u"], ds)
    dh = dy + norm_back("ffn_norm", c["h"], proj_back("wg", dg) + proj_back("wu", du))
    da = proj_back("wo", dh).reshape(b, t, nh, hd)
    dqr, dkr, dv = R.attention_backward(c["qr"], c["kr"], c["v"], c["att4"], c["lse"], da)
    dq = R.rope_backward(dqr, cfg.rope_theta).reshape(m, nh * hd)
    dk = R.rope_backward(dkr, cfg.rope_theta).reshape(m, nkv * hd)
    dxn = proj_back("wq", dq) + proj_back("wk", dk) + proj_back("wv", dv.reshape(m, nkv * hd))
    return dh + norm_back("attn_norm", c["x"], dxn)


def loss(wt: dict, x, dout, cfg, lora: bool) -> float:
    """``<stack(x), dout>``: the scalar whose gradients the training graph computes."""
    for i in range(cfg.n_blocks):
        x, _ = block_forward(wt, f"b{i}.", x, cfg, lora)
    return float(np.sum(x * dout))


def lm_head(wt: dict, x, labels, eps: float) -> tuple[float, np.ndarray]:
    """(mean cross-entropy, its gradient with respect to ``x``) of the final norm and LM head
    on the last block's output ``x`` (M, H), float64; ``labels`` (M,) negative where ignored."""
    xf = R.rmsnorm(x, wt["norm"], eps)
    logits = R.linear(xf, wt["lm_head"])  # (M, V)
    lab = np.asarray(labels).astype(np.int64)
    valid = lab >= 0
    n = max(int(valid.sum()), 1)
    mx = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - mx)
    tot = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(lab))
    safe = np.where(valid, lab, 0)
    loss = float(np.sum(np.where(valid, np.log(tot[:, 0]) + mx[:, 0] - logits[rows, safe], 0.0)) / n)
    d = e / tot
    d[rows, safe] -= 1.0
    d *= (valid / n)[:, None]
    dxf = R.linear_backward_x(d, wt["lm_head"])
    return loss, R.rmsnorm_backward(x, wt["norm"], dxf, eps)[0]


def reference_loss(tg, values: dict[int, np.ndarray]) -> float:
    """The step's loss in float64: ``<stack(x), dout>``, or with ``loss="lm"`` the mean
    cross-entropy of the head (:func:`lm_head`)."""
    g, cfg, lora = tg.graph, tg.config, tg.variant == "lora"
    wt = {t.name: values[t.id].astype(np.float64) for t in g.tensors if t.id in values}
    x = wt["x"]
    for i in range(cfg.n_blocks):
        x, _ = block_forward(wt, f"b{i}.", x, cfg, lora)
    if tg.loss == "lm":
        return lm_head(wt, x, values[tg.labels], cfg.eps)[0]
    return float(np.sum(x * wt["dout"]))


def reference_train_step(tg, values: dict[int, np.ndarray]) -> tuple[dict, dict]:
    """(gradients, updates) of a :class:`~vmstoolkit.exec.train_graph.TrainGraph` for host
    ``values`` (by tensor id), in float64: ``grads[name]`` and ``updates[name] = (w, m, v)``."""
    g, cfg, lora = tg.graph, tg.config, tg.variant == "lora"
    wt = {t.name: values[t.id].astype(np.float64) for t in g.tensors if t.id in values}
    x = wt["x"]
    caches = []
    for i in range(cfg.n_blocks):
        x, c = block_forward(wt, f"b{i}.", x, cfg, lora)
        caches.append(c)
    grads: dict = {}
    dy = lm_head(wt, x, values[tg.labels], cfg.eps)[1] if tg.loss == "lm" else wt["dout"]
    for i in reversed(range(cfg.n_blocks)):
        dy = block_backward(wt, f"b{i}.", caches[i], dy, cfg, lora, grads)
    updates = {}
    hp = tg.adamw.params()
    for name, grad in grads.items():
        mname, vname = name + ".adam_m", name + ".adam_v"
        updates[name] = R.adamw(wt[name], grad, wt[mname], wt[vname], **hp)
    return grads, updates
