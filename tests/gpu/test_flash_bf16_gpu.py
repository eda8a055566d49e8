"""On a real GPU only: the bf16 flash-attention forward (``kernels/flash_bf16.py``) on torch bf16
tensors (viewed as int16) against torch's SDPA in bf16 and an fp32 truth (SDPA in float32 on the same
bf16 values), at ragged T, GQA groups 1, 4 and 8, head dims 64 and 128; the row log-sum-exps
against torch's ``logsumexp`` of the fp32 scores; views (a fused QKV projection, a (B, nh, T, D)
layout transposed, a head-dim offset that defeats cp.async) and an output view whose neighbours
must stay untouched; ``bf16.reference_attention`` at a small shape.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_flash_bf16_gpu.py -q

Error measure (Note [bf16 noise]): ``err(a, b) = max |a - b| / max |b|``. Ours must be as close to
the fp32 truth as SDPA's bf16 output is, up to a factor 2 and one bf16 ulp of the scale:
``err(ours, truth) <= 2 err(sdpa_bf16, truth) + 2u``.
"""

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bf16 import bf, err, nb  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

U = 2.0 ** -8  # bf16 unit roundoff


@pytest.fixture(autouse=True)
def _seed():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)


def sdpa(q, k, v):
    """torch SDPA, causal, on (B, T, n, D) tensors (K/V repeated to the query heads)."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)


def lse_truth(q, k):
    g = q.shape[2] // k.shape[2]
    qh, kh = q.float().transpose(1, 2), k.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, nh, T, D)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    t = q.shape[1]
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), 1), float("-inf"))
    return torch.logsumexp(s, -1)  # (B, nh, T)


def run(q, k, v, o=None, with_lse=True, **kw):
    from numba import cuda

    from vmstoolkit.kernels import flash_bf16 as FB

    b, t, nh, _ = q.shape
    o = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16) if o is None else o
    lse = torch.full((b, nh, t), float("nan"), device="cuda") if with_lse else None
    FB.flash_attention_bf16(nb(q), nb(k), nb(v), nb(o), lse=nb(lse) if with_lse else None, **kw)
    cuda.synchronize()
    return o, lse


def check(q, k, v, o, lse=None):
    assert not o.isnan().any()
    truth = sdpa(q.float(), k.float(), v.float())
    theirs = sdpa(q, k, v)
    e_ours, e_theirs = err(o, truth), err(theirs, truth)
    assert e_ours <= 2 * e_theirs + 2 * U, (e_ours, e_theirs)
    if lse is not None:
        want = lse_truth(q, k)
        assert (lse - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    return e_ours, e_theirs


@pytest.mark.parametrize("b, t, nh, nkv, d", [
    (1, 1000, 8, 8, 64),    # group 1, ragged T
    (2, 777, 8, 2, 128),    # group 4
    (1, 1031, 16, 2, 64),   # group 8
    (1, 1031, 16, 2, 128),  # group 8
    (1, 2048, 32, 8, 128),  # a benchmark shape, whole tiles
    (3, 5, 4, 1, 128),      # T below one tile
    (1, 1, 2, 1, 64),       # T = 1
])
def test_against_sdpa(b, t, nh, nkv, d):
    q, k, v = bf(b, t, nh, d), bf(b, t, nkv, d), bf(b, t, nkv, d)
    o, lse = run(q, k, v)
    check(q, k, v, o, lse)


@pytest.mark.parametrize("d", [64, 128])
def test_tile_shapes_and_no_lse(d):
    from vmstoolkit.kernels import flash_bf16 as FB

    q, k, v = bf(1, 613, 8, d), bf(1, 613, 2, d), bf(1, 613, 2, d)
    ref, _ = run(q, k, v)
    for tiles in (FB.FlashBf16Tiles(4, 32), FB.FlashBf16Tiles(8, 64)):
        o, lse = run(q, k, v, tiles=tiles)
        check(q, k, v, o, lse)
    o, _ = run(q, k, v, with_lse=False)
    assert torch.equal(o, ref)


def test_views_and_strides():
    """q, k, v out of a fused (B, T, nh + 2 nkv, D) projection (cp.async: strides multiples of 8);
    a (B, nh, T, D) layout transposed; a head-dim offset of 1 (not 16-byte aligned: element-wise
    loads, the same bits); an output view of a wider tensor whose other columns stay untouched."""
    b, t, nh, nkv, d = 2, 301, 8, 2, 64
    qkv = bf(b, t, nh + 2 * nkv, d)
    q, k, v = qkv[:, :, :nh], qkv[:, :, nh:nh + nkv], qkv[:, :, nh + nkv:]
    o, lse = run(q, k, v)
    check(q, k, v, o, lse)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    o_c, _ = run(qc, kc, vc)
    assert torch.equal(o, o_c)
    qt = bf(b, nh, t, d).transpose(1, 2)  # (B, T, nh, D) with strides (nh T D, D, T D, 1)
    o, lse = run(qt, kc, vc)
    check(qt, kc, vc, o, lse)
    wide = bf(b, t, nh, d + 1)
    qo = wide[..., 1:]  # base 2 bytes past 16-byte alignment
    o, _ = run(qo, kc, vc)
    o_el, _ = run(qo.contiguous(), kc, vc, cp_async=False)
    o_as, _ = run(qo.contiguous(), kc, vc)
    assert torch.equal(o, o_el) and torch.equal(o, o_as)
    out_wide = torch.full((b, t, nh, d + 16), 7.0, device="cuda", dtype=torch.bfloat16)
    run(qc, kc, vc, o=out_wide[..., 8:8 + d])
    assert torch.equal(out_wide[..., 8:8 + d], o_c)
    assert (out_wide[..., :8] == 7).all() and (out_wide[..., 8 + d:] == 7).all()


def test_against_the_numpy_reference():
    """Against ``bf16.reference_attention`` (exact sums, P rounded to bf16): within one bf16 ulp of
    the scale (the kernel rounds P against the running max, the reference against the final one)."""
    from vmstoolkit.kernels import bf16 as B

    q, k, v = bf(1, 203, 4, 128), bf(1, 203, 1, 128), bf(1, 203, 1, 128)
    o, _ = run(q, k, v)
    want = B.reference_attention(*(x.float().cpu().numpy() for x in (q, k, v)), round_p=True)
    got = o.float().cpu().numpy()
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= 2 * U


def _grads(q, k, v, do, bw=None, **kw):
    """Our gradients; ``kw`` go to the forward and the backward, ``bw`` to the backward alone."""
    from numba import cuda

    from vmstoolkit.kernels import flash_bf16 as FB

    o, lse = run(q, k, v, **kw)
    dq, dk, dv = (torch.full(x.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for x in (q, k, v))
    FB.flash_attention_bf16_backward(nb(q), nb(k), nb(v), nb(o), nb(lse), nb(do), nb(dq), nb(dk), nb(dv), **kw,
                                     **(bw or {}))
    cuda.synchronize()
    return dq, dk, dv


def _autograd(q, k, v, do):
    """SDPA's gradients (bf16 inputs: its flash/efficient backward; float32 inputs: the truth)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = sdpa(*leaves)
    return torch.autograd.grad(out, leaves, do.to(out.dtype))


@pytest.mark.parametrize("b, t, nh, nkv, d", [
    (1, 1000, 8, 8, 64),    # group 1, ragged T
    (2, 777, 8, 2, 128),    # group 4
    (1, 1031, 16, 2, 64),   # group 8
    (1, 1031, 16, 2, 128),  # group 8
    (3, 5, 4, 1, 128),      # T below one tile
])
@pytest.mark.parametrize("bw", ["two kernels", "fused w4/kv64", "fused w8/kv64", "fused w4/kv32", "fused w4/kv64 split"])
def test_backward_against_sdpa(b, t, nh, nkv, d, bw):
    """dq, dk, dv against the fp32 truth as close as SDPA's bf16 backward is (Note [bf16 noise]'s
    rule: err(ours, truth) <= 2 err(sdpa_bf16, truth) + 2u): the two-kernel backward and the fused
    one (dQ added atomically) on the tiles where each warp has a row group of dQ, where two warps
    share one (w8/kv64) and where four do (w4/kv32), and with a block per query head (split)."""
    from vmstoolkit.kernels import flash_bf16 as FB

    kw = {}
    if bw.startswith("fused"):
        w, kv = bw.split()[1].split("/")
        kw = {"fused": True, "dkv_tiles": FB.FlashBf16Tiles(int(w[1:]), int(kv[2:])), "split_heads": bw.endswith("split")}
    q, k, v, do = bf(b, t, nh, d), bf(b, t, nkv, d), bf(b, t, nkv, d), bf(b, t, nh, d)
    ours = _grads(q, k, v, do, bw=kw)
    truth = _autograd(q.float(), k.float(), v.float(), do.float())
    theirs = _autograd(q, k, v, do)
    for name, a, w, th in zip(("dq", "dk", "dv"), ours, truth, theirs):
        assert not a.isnan().any(), name
        e_ours, e_theirs = err(a, w), err(th, w)
        assert e_ours <= 2 * e_theirs + 2 * U, (name, e_ours, e_theirs)


def test_backward_views_and_tiles():
    """Views of a fused projection (cp.async) and a head-dim offset (element-wise loads) give the
    contiguous inputs' bits; another tile shape agrees with the truth."""
    from vmstoolkit.kernels import flash_bf16 as FB

    b, t, nh, nkv, d = 1, 301, 8, 2, 64
    qkv = bf(b, t, nh + 2 * nkv, d)
    q, k, v = qkv[:, :, :nh], qkv[:, :, nh:nh + nkv], qkv[:, :, nh + nkv:]
    do = bf(b, t, nh, d)
    ref = _grads(q.contiguous(), k.contiguous(), v.contiguous(), do)
    for a, r in zip(_grads(q, k, v, do), ref):
        assert torch.equal(a, r)
    wide = bf(b, t, nh, d + 1)
    wide[..., 1:] = do
    for a, r in zip(_grads(q.contiguous(), k.contiguous(), v.contiguous(), wide[..., 1:]), ref):
        assert torch.equal(a, r)
    truth = _autograd(q.float(), k.float(), v.float(), do.float())
    for a, w in zip(_grads(q, k, v, do, tiles=FB.FlashBf16Tiles(4, 32)), truth):
        assert err(a, w) <= 3 * U


def test_fused_backward_refuses_a_misaligned_accumulator():
    """The fused backward adds dQ's pairs 8 bytes at a time: an accumulator that starts 4 bytes off
    is refused in one line, not a misaligned-address fault."""
    from vmstoolkit.errors import KernelError
    from vmstoolkit.kernels import flash_bf16 as FB

    q, k, v, do = bf(1, 64, 2, 64), bf(1, 64, 1, 64), bf(1, 64, 1, 64), bf(1, 64, 2, 64)
    acc = torch.zeros(1 * 64 * 2 * 64 + 1, device="cuda")[1:].view(1, 64, 2, 64)
    with pytest.raises(KernelError, match="dq_accum must start on 8 bytes"):
        _grads(q, k, v, do, bw={"fused": True, "dq_accum": nb(acc)})
