"""On a real GPU only: the backward kernels, AdamW and a whole 2-block training step against
``torch.autograd`` / ``torch.optim.AdamW`` in fp32 (TF32 off).

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_train_kernels_gpu.py -q
"""

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

RTOL = 1e-4


@pytest.fixture(autouse=True)
def _fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)


def nb(t):
    """A numba view of a contiguous torch CUDA tensor (no copy)."""
    from numba import cuda

    return cuda.as_cuda_array(t.detach().contiguous())


def sync():
    from numba import cuda

    cuda.synchronize()
    torch.cuda.synchronize()


def close(got, want, rtol=RTOL):
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= rtol, err


def dev(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).requires_grad_()


def rope_torch(x, theta):  # (B, T, nh, hd), HF rotate_half
    b, t, nh, hd = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd))
    ang = torch.outer(torch.arange(t, dtype=torch.float64, device=x.device), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().float()[None, :, None], emb.sin().float()[None, :, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)
    return x * cos + rot * sin


def attention_torch(q, k, v):  # (B, T, nh, hd), (B, T, nkv, hd)
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (a.transpose(1, 2) for a in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("m, n, k", [(300, 256, 128), (2048, 1024, 4096), (77, 16, 4096)])
def test_linear_backward(m, n, k):
    from vmstoolkit.kernels.gemm import linear_dw, linear_dx

    x, w = dev(m, k), dev(n, k, scale=1 / math.sqrt(k))
    dy = torch.randn(m, n, device="cuda")
    torch.nn.functional.linear(x, w).backward(dy)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    acc = torch.randn_like(w)
    dw2 = torch.empty_like(w)
    linear_dx(nb(dy), nb(w), nb(dx))
    linear_dw(nb(dy), nb(x), nb(dw))
    linear_dw(nb(dy), nb(x), nb(dw2), acc=nb(acc))
    sync()
    close(dx, x.grad)
    close(dw, w.grad)
    close(dw2, w.grad + acc)


def test_rmsnorm_backward():
    from vmstoolkit.kernels.rmsnorm import rmsnorm_backward_dw, rmsnorm_backward_dx

    x, w = dev(333, 4096), (1 + 0.1 * torch.randn(4096, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    y.backward(dy)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    rmsnorm_backward_dx(nb(x), nb(w), nb(dy), nb(dx), 1e-5)
    rmsnorm_backward_dw(nb(x), nb(dy), nb(dw), 1e-5)
    sync()
    close(dx, x.grad)
    close(dw, w.grad)


def test_rope_backward():
    from vmstoolkit.kernels.rope import rope_backward

    x = dev(1, 1000, 8, 128)
    dy = torch.randn_like(x)
    rope_torch(x, 10000.0).backward(dy)
    dx = torch.empty_like(x)
    rope_backward(nb(dy), nb(dx), 10000.0)
    sync()
    close(dx, x.grad)


@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("t, nh, nkv, hd", [(1000, 8, 2, 128), (257, 4, 4, 128), (333, 8, 1, 64), (70, 4, 2, 66)])
def test_attention_backward_gqa(t, nh, nkv, hd, variant):
    from vmstoolkit.kernels.attention import attention
    from vmstoolkit.kernels.attention_backward import attention_backward

    q, k, v = dev(1, t, nh, hd), dev(1, t, nkv, hd), dev(1, t, nkv, hd)
    do = torch.randn(1, t, nh, hd, device="cuda")
    ref = attention_torch(q, k, v)
    ref.backward(do)
    o = torch.empty(1, t, nh, hd, device="cuda")
    lse = torch.empty(1, nh, t, device="cuda")
    attention(nb(q), nb(k), nb(v), nb(o), lse=nb(lse))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward(nb(q), nb(k), nb(v), nb(o), nb(lse), nb(do), nb(dq), nb(dk), nb(dv), variant=variant)
    sync()
    close(o, ref.detach())
    close(dq, q.grad)
    close(dk, k.grad)
    close(dv, v.grad)


@pytest.mark.parametrize("t, nh, nkv", [(1000, 32, 8), (1, 8, 2), (333, 4, 4)])
@pytest.mark.parametrize("launch", [{"variant": 1}, {"variant": 2, "splits": 1}, {"variant": 2, "splits": 3}, {}])
def test_attention_forward_variants_and_lse(t, nh, nkv, launch):
    from vmstoolkit.kernels.attention import attention

    q, k, v = (torch.randn(1, t, n, 128, device="cuda") for n in (nh, nkv, nkv))
    ref = attention_torch(q, k, v)
    qh, kh = q.transpose(1, 2), k.repeat_interleave(nh // nkv, 2).transpose(1, 2)
    ref_lse = torch.logsumexp((qh @ kh.transpose(-1, -2) / math.sqrt(128)).masked_fill(
        torch.ones(t, t, device="cuda", dtype=torch.bool).triu(1), float("-inf")), -1)  # (1, nh, T)
    o, lse = torch.empty(1, t, nh, 128, device="cuda"), torch.empty(1, nh, t, device="cuda")
    attention(nb(q), nb(k), nb(v), nb(o), lse=nb(lse), **launch)
    sync()
    close(o, ref)
    close(lse, ref_lse)


def test_swiglu_backward():
    from vmstoolkit.kernels.swiglu import swiglu_backward

    g, u = dev(300, 1000, scale=3.0), dev(300, 1000)
    ds = torch.randn_like(g)
    (torch.nn.functional.silu(g) * u).backward(ds)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    swiglu_backward(nb(g), nb(u), nb(ds), nb(dg), nb(du))
    sync()
    close(dg, g.grad)
    close(du, u.grad)


def test_adamw_matches_torch_optim():
    from vmstoolkit.kernels.adamw import adamw

    p = torch.nn.Parameter(torch.randn(10000, device="cuda"))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    w, m, v = p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)
    for step in (1, 2, 3):
        grad = torch.randn_like(p)
        p.grad = grad.clone()
        opt.step()
        outs = [torch.empty_like(p) for _ in range(3)]
        adamw(nb(w), nb(grad), nb(m), nb(v), *(nb(o) for o in outs), lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
              weight_decay=0.1, step=step)
        sync()
        w, m, v = (o.detach() for o in outs)
        close(w, p.detach(), 1e-5)
        close(m, opt.state[p]["exp_avg"], 1e-5)
        close(v, opt.state[p]["exp_avg_sq"], 1e-5)


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_two_block_training_step_equals_torch_autograd(variant):
    """The whole training graph, run directly on the GPU with our kernels, against a torch
    implementation of the same model differentiated by autograd."""
    from vmstoolkit.exec.backends.cuda import direct_forward
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_graph import build_train_step, grads_from_updates, random_train_values

    cfg = LlamaConfig(n_blocks=2, seq=300, hidden=512, heads=4, kv_heads=2, ffn=1024)
    tg = build_train_step(cfg, variant, rank=8)
    values = random_train_values(tg, seed=1)
    out, _ = direct_forward(tg.graph, values, repeats=1)
    ours = grads_from_updates(tg, values, out)
    p = {t.name: torch.tensor(values[t.id], device="cuda", requires_grad=t.name in tg.params)
         for t in tg.graph.tensors if t.id in values}

    def proj(pre, name, xin):
        y = torch.nn.functional.linear(xin, p[pre + name])
        if variant == "lora":
            y = y + torch.nn.functional.linear(torch.nn.functional.linear(xin, p[pre + name + ".lora_a"]),
                                               p[pre + name + ".lora_b"])
        return y

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * w

    x = p["x"]
    b, t, nh, nkv, hd = 1, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    for i in range(cfg.n_blocks):
        pre = f"b{i}."
        xn = norm(x, p[pre + "attn_norm"])
        q = rope_torch(proj(pre, "wq", xn).view(b, t, nh, hd), cfg.rope_theta)
        k = rope_torch(proj(pre, "wk", xn).view(b, t, nkv, hd), cfg.rope_theta)
        v = proj(pre, "wv", xn).view(b, t, nkv, hd)
        h = x + proj(pre, "wo", attention_torch(q, k, v).reshape(b * t, nh * hd))
        hn = norm(h, p[pre + "ffn_norm"])
        x = h + proj(pre, "wd", torch.nn.functional.silu(proj(pre, "wg", hn)) * proj(pre, "wu", hn))
    (x * p["dout"]).sum().backward()
    for name, g in ours.items():
        close(torch.tensor(g, device="cuda", dtype=torch.float32), p[name].grad)


def test_direct_step_breakdown_and_variant2_backward_gradients(monkeypatch):
    """direct_forward(breakdown=True) on a 2-block LoRA step: CUDA events give a positive time to
    every op kind, summing to about the step's time; the step with attention backward variant 2
    gives the same gradients as with variant 1."""
    from vmstoolkit.exec.backends.cuda import direct_forward
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_graph import build_train_step, grads_from_updates, random_train_values
    from vmstoolkit.kernels import attention_backward

    cfg = LlamaConfig(n_blocks=2, seq=300, hidden=512, heads=4, kv_heads=2, ffn=1024)
    tg = build_train_step(cfg, "lora", rank=8)
    values = random_train_values(tg, seed=1)
    monkeypatch.setattr(attention_backward, "DEFAULT_VARIANT", 1)
    out1, best, per_op = direct_forward(tg.graph, values, repeats=2, breakdown=True)
    assert set(per_op) == {v.op for v in tg.graph.vertices} and "attention_backward" in per_op
    assert all(s > 0 for s in per_op.values())
    assert 0.3 * best <= sum(per_op.values()) <= 3 * best
    monkeypatch.setattr(attention_backward, "DEFAULT_VARIANT", 2)
    out2, _ = direct_forward(tg.graph, values, repeats=1)
    g1, g2 = grads_from_updates(tg, values, out1), grads_from_updates(tg, values, out2)
    for name in g1:
        close(torch.tensor(g2[name]), torch.tensor(g1[name]), 1e-4)
