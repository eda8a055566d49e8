"""Validation at full size and benchmark of the Numba kernels on a real GPU (issue 5).

Prints, in one run:
1. correctness: the Numba LLaMA block against ``transformers``' ``LlamaDecoderLayer`` (fp32, eager
   attention, explicit causal mask) and against ``reference.llama_block``, at hidden 2048,
   16 heads (16 and 4 key/value heads), seq 1024; attention against SDPA; GEMM against cuBLAS;
2. GEMM TFLOP/s of the launcher's choice against cuBLAS fp32 (torch.matmul, TF32 off) at 4096^3
   and at the block's shapes, each best of 7 batches of 5 back-to-back launches (every
   candidate tile shape: ``experiments/gemm_sweep.py``);
3. causal GQA attention against ``torch.nn.functional.scaled_dot_product_attention`` in fp32 at
   T = 1024, 2048, 4096, 8192 (batch 1, 32 heads of 128, 8 key/value heads): attention variant 1
   (the first kernel), variant 2 as the launcher runs it and at other tile shapes, head groupings
   and split-KV counts, each as its time divided by SDPA's (goal: at most 1.0). SDPA is timed two
   ways, on the GQA inputs (``enable_gqa=True``) and on K/V repeated to 32 heads beforehand (the
   repeat not timed: it lets PyTorch pick its memory-efficient kernel); the ratio is to the
   faster of the two. Best of several batches of back-to-back launches, all in this process;
4. the whole block against the transformers layer in fp32 (its eager attention with an explicit
   mask, and its SDPA attention), with the per-kernel breakdown, at ``BLOCK_SHAPES``;
5. the RMSNorm backward (dx, and dw at each of ``RMS_DW_TILES``) at R = 2048 and 256 rows of 4096:
   milliseconds, the GB/s of reading x and dy once, the error against ``torch.autograd`` and
   whether two runs give the same bits.

Relative error everywhere: max |ours - theirs| / max |theirs|. About 3 minutes on an H200.

    python3 experiments/kernels_bench.py --out DIR                    # writes DIR/kernels_bench.json
    python3 experiments/kernels_bench.py --out DIR --only attention   # section 3 alone
    python3 experiments/kernels_bench.py --out DIR --only rmsnorm     # section 5 alone (seconds)
    python3 experiments/kernels_bench.py --out DIR --only gemm block  # sections 2 and 4
    python3 experiments/kernels_bench.py --out DIR --only block_bf16  # 4b: the block in bf16 (issue 33)
    python3 experiments/kernels_bench.py --out DIR --only attention_bf16  # 3b: bf16 flash attention (issue 33)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from numba import cuda

from common import run_env, say, tf32_off, time_best, time_events, time_held

from vmstoolkit.kernels import LlamaBlock, LlamaBlockConfig, llama_block_forward
from vmstoolkit.kernels import attention as A
from vmstoolkit.kernels import gemm as G
from vmstoolkit.kernels import reference as R
from vmstoolkit.kernels.residual import residual_add
from vmstoolkit.kernels.rmsnorm import DwTiles, rmsnorm, rmsnorm_backward_dw, rmsnorm_backward_dx
from vmstoolkit.kernels.rope import rope
from vmstoolkit.kernels.swiglu import swiglu

RESULTS: dict = {}


def rel(a, b) -> float:
    a = a.detach().double().cpu().numpy() if torch.is_tensor(a) else np.asarray(a, np.float64)
    b = b.detach().double().cpu().numpy() if torch.is_tensor(b) else np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def time_numba(fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` (enqueues on the default stream), by Numba's CUDA events."""
    return time_events(fn, iters, warmup, events="numba")


def time_torch(fn, iters: int, warmup: int = 2) -> float:
    return time_events(fn, iters, warmup)


# ---- HF layer ---------------------------------------------------------------------------------


def hf_layer(c: LlamaBlockConfig, seed: int):
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ML

    hc = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.ffn_size,
                     num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                     num_hidden_layers=1, rms_norm_eps=c.rms_eps, max_position_embeddings=8192,
                     attention_bias=False, mlp_bias=False)
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = ML.LlamaDecoderLayer(hc, layer_idx=0).cuda().float().eval()
    with torch.no_grad():  # non-trivial norm weights (HF initialises them to ones)
        layer.input_layernorm.weight.add_(0.1 * torch.randn_like(layer.input_layernorm.weight))
        layer.post_attention_layernorm.weight.add_(
            0.1 * torch.randn_like(layer.post_attention_layernorm.weight))
    rot = ML.LlamaRotaryEmbedding(config=hc).cuda()
    theta = getattr(hc, "rope_theta", None) or (getattr(hc, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    assert float(theta) == c.rope_theta, f"HF rope theta {theta} != {c.rope_theta}"
    return layer, rot


def hf_forward(layer, rot, x, attn: str = "eager"):
    """The layer's output for ``x`` with ``attn`` = "eager" (an explicit additive causal mask)
    or "sdpa" (no mask: transformers then calls SDPA with ``is_causal=True``, as its models do)."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device)[None].expand(b, t)
    cos, sin = rot(x, pos)
    layer.self_attn.config._attn_implementation = attn
    mask = None
    if attn == "eager":
        mask = torch.full((t, t), torch.finfo(torch.float32).min, device=x.device).triu(1)
        mask = mask[None, None].expand(b, 1, t, t)  # (B, 1, T, T) additive causal mask
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin),
                use_cache=False)
    return out[0] if isinstance(out, tuple) else out


# ---- 1. correctness ---------------------------------------------------------------------------


def check_block(c: LlamaBlockConfig, b: int, t: int, seed: int = 0) -> dict:
    layer, rot = hf_layer(c, seed)
    sd = {k: v.detach().contiguous() for k, v in layer.state_dict().items()}
    x = torch.randn(b, t, c.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    with torch.no_grad():
        want = hf_forward(layer, rot, x)  # (B, T, H)
    # numpy in, numpy out, CPU torch weights
    ours_np = llama_block_forward(x.cpu().numpy(), {k: v.cpu() for k, v in sd.items()}, c)
    # device in (torch CUDA tensor through __cuda_array_interface__), device out
    ours_dev = llama_block_forward(x, sd, c).copy_to_host()
    ref = R.llama_block(x.cpu().numpy(), {k: v.cpu().numpy() for k, v in sd.items()},
                        c.n_heads, c.n_kv_heads, c.rms_eps, c.rope_theta)
    rec = {
        "config": c.__dict__, "batch": b, "seq": t,
        "rel_err_vs_transformers": rel(ours_np, want),
        "rel_err_device_path_vs_transformers": rel(ours_dev, want),
        "rel_err_vs_numpy_reference": rel(ours_np, ref),
        "rel_err_numpy_reference_vs_transformers": rel(ref, want),
        "max_abs_err_vs_transformers": float(np.max(np.abs(ours_np - want.cpu().numpy()))),
        "max_abs_transformers": float(want.abs().max()),
    }
    rec["pass_1e-4"] = max(rec["rel_err_vs_transformers"],
                           rec["rel_err_device_path_vs_transformers"]) <= 1e-4
    return rec


# ---- 2. GEMM ----------------------------------------------------------------------------------

def bench_gemm(shapes) -> list[dict]:
    rows = []
    for name, (m, n, k) in shapes:
        x = torch.randn(m, k, device="cuda")  # (M, K)
        w = torch.randn(n, k, device="cuda")  # (N, K)
        y = torch.empty(m, n, device="cuda")  # (M, N)
        flops = 2.0 * m * n * k
        # best of 7 batches of 5 back-to-back launches, as gemm_sweep.py times: a Numba launch's
        # host cost (~20-40 us, a split launch's zero fill too) overlaps the kernels, which a
        # lone launch of these 50-300 us GEMMs would time
        t_cublas = time_best(lambda: torch.matmul(x, w.T, out=y), 5, 7, 2, events="torch")[0]
        want = y.clone()
        dx, dw, dy = cuda.as_cuda_array(x), cuda.as_cuda_array(w), cuda.as_cuda_array(y)
        configs = [("auto", None, None)]  # the launcher's choice (gemm.choose)
        for label, tiles, v in configs:
            y.zero_()
            G.gemm(dx, dw, dy, tiles=tiles, variant=v)
            cuda.synchronize()
            err = rel(y, want)
            ms = time_best(lambda: G.gemm(dx, dw, dy, tiles=tiles, variant=v), 5, 7, 2)[0]
            auto = G.choose(m, n, k)
            chosen = tiles or auto.tiles
            rows.append({
                "shape": name, "M": m, "N": n, "K": k, "config": label,
                "tiles": chosen.__dict__, "variant": auto.variant if v is None else v,
                "splits": auto.splits if tiles is None else 1,
                "ms": ms, "tflops": flops / ms / 1e9, "cublas_ms": t_cublas,
                "cublas_tflops": flops / t_cublas / 1e9, "pct_of_cublas": 100 * t_cublas / ms,
                "rel_err_vs_cublas": err,
            })
            r = rows[-1]
            say(f"  {name:<22} {label:<22} {r['tflops']:6.2f} TFLOP/s  cuBLAS {r['cublas_tflops']:6.2f}"
                f"  {r['pct_of_cublas']:5.1f}%  err {err:.1e}")
    return rows


# ---- 3. attention -----------------------------------------------------------------------------

ATT_T = (1024, 2048, 4096, 8192)
ATT_SHAPE = (1, 32, 8, 128)  # (B, nh, nkv, hd)
ATT_REPS_T = 8192  # a timed batch is ATT_REPS_T // T launches
# (label, launch keywords of A.attention): the launcher's choice (the default FlashTiles(): 4x4
# scores, both loops double-buffered; run4 of experiments/results/kernels-h200/), then
# attention.FLASH_CANDIDATES (its comment has their last timings). A label names the switches on.
def _flash_label(t) -> str:
    parts = [tag for name, tag in (("dbuf", "db"), ("pv_dbuf", "pv"), ("exp2", "e2")) if getattr(t, name)]
    if t.blocks_per_sm != 4:
        parts.append(f"{t.blocks_per_sm}blk")
    if t.to != 4:
        parts.append(f"to{t.to}")
    return "v2 " + ("+".join(parts) or "plain")


ATT_CONFIGS = [("v2 auto", {})] + [(_flash_label(t), {"tiles": t}) for t in A.FLASH_CANDIDATES]


def bench_attention(ts=ATT_T, configs=ATT_CONFIGS) -> list[dict]:
    import torch.nn.functional as F

    b, nh, nkv, hd = ATT_SHAPE
    rows = []
    for t in ts:
        g = torch.Generator("cuda").manual_seed(1)
        q = torch.randn(b, t, nh, hd, device="cuda", generator=g)  # (B, T, nh, hd)
        k = torch.randn(b, t, nkv, hd, device="cuda", generator=g)  # (B, T, nkv, hd)
        v = torch.randn(b, t, nkv, hd, device="cuda", generator=g)
        o = torch.empty_like(q)
        qh, kh, vh = (a.transpose(1, 2).contiguous() for a in (q, k, v))  # (B, n, T, hd)
        kr, vr = (a.repeat_interleave(nh // nkv, dim=1) for a in (kh, vh))  # (B, nh, T, hd)
        flops = 4.0 * b * nh * hd * t * (t + 1) / 2
        reps = max(1, ATT_REPS_T // t)  # launches per timed batch: ~ equal time per batch across T
        sdpa = {
            "gqa": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True),
            "expanded": lambda: F.scaled_dot_product_attention(qh, kr, vr, is_causal=True),
        }
        sd_ms = {}
        for name, fn in sdpa.items():
            try:
                sd_ms[name] = time_best(fn, reps, events="torch")[0]
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: compare with the other
                say(f"  T{t}: SDPA {name} FAILED: {type(e).__name__}: {e}")
                sd_ms[name] = float("inf")
                torch.cuda.empty_cache()
        want = (sdpa["expanded"] if sd_ms["expanded"] < float("inf") else sdpa["gqa"])().transpose(1, 2)
        sdpa_ms = min(sd_ms.values())  # (want: B, T, nh, hd)
        say(f"  T{t}: SDPA gqa {sd_ms['gqa']:.3f} ms, SDPA expanded K/V {sd_ms['expanded']:.3f} ms "
            f"({flops / sdpa_ms / 1e9:.1f} TFLOP/s at the faster)")
        dq, dk, dv, do = (cuda.as_cuda_array(a) for a in (q, k, v, o))
        rec = {"B": b, "T": t, "nh": nh, "nkv": nkv, "hd": hd, "sdpa_gqa_ms": sd_ms["gqa"],
               "sdpa_expanded_ms": sd_ms["expanded"], "sdpa_ms": sdpa_ms, "configs": {}}
        for label, kw in configs:
            try:
                launch = A.choose(b, t, nh, nkv, hd, kw.get("variant"), kw.get("tiles"), kw.get("splits"))
                ws = A.workspace_for(b, t, nh, nkv, hd, variant=kw.get("variant"), tiles=kw.get("tiles"),
                                     splits=kw.get("splits"))

                def run():
                    A.attention(dq, dk, dv, do, workspace=ws, **kw)

                o.fill_(float("nan"))
                run()
                cuda.synchronize()
                err = rel(o, want)
                best, med = time_best(run, reps)
            except Exception as e:  # noqa: BLE001 - keep the table going, record the failure
                say(f"    {label:<20} FAILED: {type(e).__name__}: {e}")
                rec["configs"][label] = {"error": f"{type(e).__name__}: {e}"}
                continue
            what = (f"v1 {launch.tiles.bq}q x {launch.tiles.bkv}k" if launch.variant == 1 else
                    f"v2 {launch.tiles.rows} rows = {launch.tiles.rows // launch.heads} pos x {launch.heads} heads, "
                    f"{launch.tiles.bkv} keys, split {launch.splits}")
            rec["configs"][label] = {"launch": what, "ms": best, "ms_median": med, "tflops": flops / best / 1e9,
                                     "ratio_to_sdpa": best / sdpa_ms, "rel_err_vs_sdpa": err}
            ok = "" if err <= 1e-4 else "  <-- ERROR > 1e-4"
            say(f"    {label:<20} {best:9.3f} ms  {flops / best / 1e9:6.1f} TFLOP/s  x{best / sdpa_ms:5.2f} SDPA's "
                f"time  err {err:.1e}  [{what}]{ok}")
        rows.append(rec)
    say("  time / SDPA's time (lower is better; goal <= 1.00), best of 5 batches:")
    say_ratios([lab for lab, _ in configs], rows, "ratio_to_sdpa", f"{'T':>6} {'SDPA ms':>9}",
               lambda rec: f"{rec['T']:>6} {rec['sdpa_ms']:9.3f}")
    return rows


def say_ratios(labels, rows, key: str, head: str, lead) -> None:
    """A table: a row per record (``lead(rec)`` first), a column per config label, ``rec['configs'][label][key]``."""
    w = max(16, *map(len, labels))
    say("  " + head + " " + " ".join(f"{lab:>{w}}" for lab in labels))
    for rec in rows:
        cells = [(f"{rec['configs'][lab][key]:{w}.2f}" if "ms" in rec["configs"].get(lab, {})
                  else f"{'failed':>{w}}") for lab in labels]
        say("  " + lead(rec) + " " + " ".join(cells))


# ---- 3b. bf16 flash attention (issue 33) ------------------------------------------------------

ATT_BF16_SHAPE = (1, 32, 8)  # (B, nh, nkv)
ATT_BF16_HD = (64, 128)


def _bf16_configs():
    from vmstoolkit.kernels import flash_bf16 as FB

    return [("w4/kv64 (default)", FB.GPU_TILES), ("w4/kv32", FB.FlashBf16Tiles(4, 32)),
            ("w8/kv64", FB.FlashBf16Tiles(8, 64))]


def bench_attention_bf16(ts=ATT_T, hds=ATT_BF16_HD) -> list[dict]:
    """The bf16 flash-attention forward and backward (``kernels/flash_bf16.py``) against SDPA in bf16, causal
    GQA, batch 1, 32 query heads, 8 key/value heads: SDPA's flash backend (on the GQA inputs with
    ``enable_gqa=True`` and on K/V repeated beforehand, the repeat not timed) and its efficient
    backend (repeated K/V). GPU time alone (``time_held``: the calls queued behind a spin, so
    Numba's launch cost is not timed), best of 5 batches. The ratio is to the faster flash-backend
    timing (issue 33's goal: at most 1.3); ``err``: max |ours - SDPA flash| / max |SDPA flash|."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vmstoolkit.kernels import flash_bf16 as FB

    b, nh, nkv = ATT_BF16_SHAPE
    rows = []
    for hd in hds:
        for t in ts:
            g = torch.Generator("cuda").manual_seed(1)
            q = torch.randn(b, t, nh, hd, device="cuda", generator=g).bfloat16()  # (B, T, nh, hd)
            k = torch.randn(b, t, nkv, hd, device="cuda", generator=g).bfloat16()  # (B, T, nkv, hd)
            v = torch.randn(b, t, nkv, hd, device="cuda", generator=g).bfloat16()
            o = torch.empty_like(q)
            lse = torch.empty(b, nh, t, device="cuda")
            qh, kh, vh = (a.transpose(1, 2).contiguous() for a in (q, k, v))  # (B, n, T, hd)
            kr, vr = (a.repeat_interleave(nh // nkv, dim=1) for a in (kh, vh))  # (B, nh, T, hd)
            flops = 4.0 * b * nh * hd * t * (t + 1) / 2
            reps = max(2, 4 * ATT_REPS_T // t)

            def sdpa(backend, kk, vv, gqa):
                def fn():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, enable_gqa=gqa)
                return fn

            cands = {"flash_gqa": sdpa(SDPBackend.FLASH_ATTENTION, kh, vh, True),
                     "flash_expanded": sdpa(SDPBackend.FLASH_ATTENTION, kr, vr, False),
                     "efficient_expanded": sdpa(SDPBackend.EFFICIENT_ATTENTION, kr, vr, False)}
            sd_ms, want = {}, None
            for name, fn in cands.items():
                try:
                    out = fn()
                    if want is None and name.startswith("flash"):
                        want = out.transpose(1, 2)  # (B, T, nh, hd)
                    sd_ms[name] = time_held(fn, reps)["best_ms"]
                except Exception as e:  # noqa: BLE001 - a backend that refuses these inputs: say so
                    say(f"  hd{hd} T{t}: SDPA {name} FAILED: {type(e).__name__}: {str(e)[:200]}")
                    sd_ms[name] = float("inf")
            flash_ms = min(sd_ms["flash_gqa"], sd_ms["flash_expanded"])
            rec = {"B": b, "T": t, "nh": nh, "nkv": nkv, "hd": hd, "sdpa_ms": sd_ms, "sdpa_flash_ms": flash_ms,
                   "configs": {}}
            say(f"  hd{hd} T{t}: SDPA flash gqa {sd_ms['flash_gqa']:.3f} ms, flash expanded {sd_ms['flash_expanded']:.3f}"
                f" ms, efficient expanded {sd_ms['efficient_expanded']:.3f} ms ({flops / flash_ms / 1e9:.0f} TFLOP/s "
                f"at the faster flash)")
            args = [cuda.as_cuda_array(a.view(torch.int16)) for a in (q, k, v, o)]
            dlse = cuda.as_cuda_array(lse)
            for label, tiles in _bf16_configs():
                def run(tiles=tiles):
                    FB.flash_attention_bf16(*args, lse=dlse, tiles=tiles)

                try:
                    o.fill_(float("nan"))
                    run()
                    cuda.synchronize()
                    err = ((o.float() - want.float()).abs().max() / want.float().abs().max()).item() \
                        if want is not None else float("nan")
                    ms = time_held(run, reps)["best_ms"]
                except Exception as e:  # noqa: BLE001 - keep the table going, record the failure
                    say(f"    {label:<20} FAILED: {type(e).__name__}: {str(e)[:300]}")
                    rec["configs"][label] = {"error": f"{type(e).__name__}: {e}"[:500]}
                    continue
                rec["configs"][label] = {"ms": ms, "tflops": flops / ms / 1e9, "ratio_to_sdpa_flash": ms / flash_ms,
                                         "ratio_to_sdpa_efficient": ms / sd_ms["efficient_expanded"],
                                         "rel_err_vs_sdpa_flash": err}
                bad = "" if err <= 1.6e-2 else "  <-- ERROR > 1.6e-2"
                say(f"    {label:<20} {ms:9.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  x{ms / flash_ms:5.2f} SDPA flash"
                    f"  x{ms / sd_ms['efficient_expanded']:5.2f} efficient  err {err:.1e}{bad}")
            rec["backward"] = _bench_bf16_backward(q, k, v, o, lse, qh, kh, vh, kr, vr, flops, reps)
            rows.append(rec)
            del q, k, v, o, lse, qh, kh, vh, kr, vr, want
            torch.cuda.empty_cache()
    say("  forward: time / SDPA flash's time (goal <= 1.30):")
    say_ratios([lab for lab, _ in _bf16_configs()], rows, "ratio_to_sdpa_flash", f"{'hd':>4} {'T':>6} {'flash ms':>9}",
               lambda rec: f"{rec['hd']:>4} {rec['T']:>6} {rec['sdpa_flash_ms']:9.3f}")
    say("  backward (default tiles): time / SDPA flash backward's time (goal <= 1.30):")
    for rec in rows:
        bw = rec["backward"]
        say(f"  {rec['hd']:>4} {rec['T']:>6} " + (f"{bw['ratio_to_sdpa_flash']:6.2f}  ({bw['ms']:.3f} ms vs "
                                                   f"{bw['sdpa_flash_ms']:.3f} ms, {bw['sdpa_inputs']})"
                                                   if "ms" in bw else f"failed: {bw.get('error', '')[:120]}"))
    return rows


def _bench_bf16_backward(q, k, v, o, lse, qh, kh, vh, kr, vr, flops, reps) -> dict:
    """The bf16 backward (default tiles) against SDPA flash's backward (``autograd.grad`` of its
    output, the forward not timed; GQA inputs where the flash backend takes them, else K/V repeated,
    whose per-head dK, dV are then not summed: a small advantage to SDPA). 2.5x the forward's FLOPs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vmstoolkit.kernels import flash_bf16 as FB

    do = torch.randn_like(q)  # (B, T, nh, hd) bf16
    doh = do.transpose(1, 2).contiguous()
    rec = {}
    for inputs, kk, vv, gqa in (("gqa", kh, vh, True), ("expanded", kr, vr, False)):
        try:
            leaves = [x.detach().clone().requires_grad_() for x in (qh, kk, vv)]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)
            want = torch.autograd.grad(out, leaves, doh, retain_graph=True)
            rec["sdpa_flash_ms"] = time_held(lambda: torch.autograd.grad(out, leaves, doh, retain_graph=True),
                                             reps)["best_ms"]
            rec["sdpa_inputs"] = inputs
            break
        except Exception as e:  # noqa: BLE001 - the flash backend refused these inputs: try the next
            say(f"    backward: SDPA flash on {inputs} inputs FAILED: {type(e).__name__}: {str(e)[:200]}")
    else:
        return {"error": "SDPA's flash backend ran on neither input layout"}
    grads = [torch.empty_like(x) for x in (q, k, v)]
    args = [cuda.as_cuda_array(a.view(torch.int16)) for a in (q, k, v, o)]
    dlse = cuda.as_cuda_array(lse)
    dsum = cuda.device_array(tuple(lse.shape), np.float32)
    gargs = [cuda.as_cuda_array(a.view(torch.int16)) for a in (do, *grads)]

    def run():
        FB.flash_attention_bf16_backward(*args, dlse, *gargs, dsum=dsum)

    try:
        FB.flash_attention_bf16(*args, lse=dlse)
        run()
        cuda.synchronize()
        g = q.shape[2] // k.shape[2]
        errs = {}
        for name, ours, theirs in zip(("dq", "dk", "dv"), grads, want):
            theirs = theirs.transpose(1, 2)  # (B, T, n, hd)
            if name != "dq" and rec["sdpa_inputs"] == "expanded":
                theirs = theirs.float().reshape(*theirs.shape[:2], -1, g, theirs.shape[-1]).sum(3)
            errs[name] = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
        ms = time_held(run, reps)["best_ms"]
    except Exception as e:  # noqa: BLE001 - record the failure, keep the table going
        say(f"    backward FAILED: {type(e).__name__}: {str(e)[:300]}")
        return {**rec, "error": f"{type(e).__name__}: {e}"[:500]}
    rec.update(ms=ms, tflops=2.5 * flops / ms / 1e9, ratio_to_sdpa_flash=ms / rec["sdpa_flash_ms"], rel_err_vs_sdpa=errs)
    say(f"    backward (w4/kv64)  {ms:9.3f} ms  {2.5 * flops / ms / 1e9:6.0f} TFLOP/s  x{ms / rec['sdpa_flash_ms']:5.2f} "
        f"SDPA flash backward ({rec['sdpa_flash_ms']:.3f} ms, {rec['sdpa_inputs']})  err " +
        " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    return rec


# ---- 4. block ---------------------------------------------------------------------------------


# (config, T) at batch 1: the acceptance shape of issue 5 (1.1B widths), and the runtime's
# 7B-wide block with GQA (the shapes of gemm_sweep.py's default set)
BLOCK_SHAPES = ((LlamaBlockConfig(), 1024),
                (LlamaBlockConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=11008), 2048))


def time_blocks(layer, rot, x, blk, dx, dout):
    """(the layer's output function, its eager ms, its SDPA ms, our block's ms), 10 calls each."""
    def hf(attn):
        with torch.no_grad():
            return hf_forward(layer, rot, x, attn)

    return (hf, time_torch(lambda: hf("eager"), 10), time_torch(lambda: hf("sdpa"), 10),
            time_numba(lambda: blk.forward_device(dx, dout), 10))


def bench_block(c: LlamaBlockConfig, b: int, t: int) -> dict:
    layer, rot = hf_layer(c, 0)
    sd = {k: v.detach().contiguous() for k, v in layer.state_dict().items()}
    x = torch.randn(b, t, c.hidden_size, device="cuda")
    out = torch.empty_like(x)
    blk = LlamaBlock(sd, c, b, t)
    dx, dout = cuda.as_cuda_array(x), cuda.as_cuda_array(out)

    hf, t_hf, t_sdpa, t_ours = time_blocks(layer, rot, x, blk, dx, dout)
    err = rel(out, hf("eager"))
    err_sdpa = rel(out, hf("sdpa"))
    m, h, f, hd = b * t, c.hidden_size, c.ffn_size, c.head_dim
    nq, nkv = c.n_heads * hd, c.n_kv_heads * hd
    parts = {
        "rmsnorm x2": time_numba(lambda: (rmsnorm(blk.x2, blk.w["input_layernorm.weight"], blk.h),
                                          rmsnorm(blk.x2, blk.w["input_layernorm.weight"], blk.h)), 10),
        "gemm q,k,v": time_numba(lambda: [G.gemm(blk.h, blk.w[f"self_attn.{p}_proj.weight"], o)
                                          for p, o in (("q", blk.q), ("k", blk.k), ("v", blk.v))], 10),
        "rope q,k": time_numba(lambda: (rope(blk.q.reshape(b, t, c.n_heads, hd), blk.q.reshape(b, t, c.n_heads, hd)),
                                        rope(blk.k.reshape(b, t, c.n_kv_heads, hd), blk.k.reshape(b, t, c.n_kv_heads, hd))), 10),
        "attention": time_numba(lambda: A.attention(blk.q.reshape(b, t, c.n_heads, hd), blk.k.reshape(b, t, c.n_kv_heads, hd),
                                                    blk.v.reshape(b, t, c.n_kv_heads, hd), blk.a.reshape(b, t, c.n_heads, hd)), 10),
        "gemm o": time_numba(lambda: G.gemm(blk.a, blk.w["self_attn.o_proj.weight"], blk.t), 10),
        "gemm gate,up": time_numba(lambda: (G.gemm(blk.h, blk.w["mlp.gate_proj.weight"], blk.g),
                                            G.gemm(blk.h, blk.w["mlp.up_proj.weight"], blk.u)), 10),
        "swiglu": time_numba(lambda: swiglu(blk.g, blk.u, blk.u), 10),
        "gemm down": time_numba(lambda: G.gemm(blk.g, blk.w["mlp.down_proj.weight"], blk.t), 10),
        "residual x2": time_numba(lambda: (residual_add(blk.x2, blk.t, blk.x2), residual_add(blk.x2, blk.t, blk.x2)), 10),
    }
    gemm_flops = 2.0 * m * h * (nq + 2 * nkv) + 2.0 * m * nq * h + 3 * 2.0 * m * h * f
    att_flops = 4.0 * b * c.n_heads * hd * t * (t + 1) / 2
    rec = {"config": c.__dict__, "batch": b, "seq": t, "ours_ms": t_ours, "transformers_ms": t_hf,
           "speed_vs_transformers": t_hf / t_ours, "rel_err_vs_transformers": err,
           "transformers_sdpa_ms": t_sdpa, "ratio_to_transformers_eager": t_ours / t_hf,
           "ratio_to_transformers_sdpa": t_ours / t_sdpa, "rel_err_vs_transformers_sdpa": err_sdpa,
           "flops": gemm_flops + att_flops, "ours_tflops": (gemm_flops + att_flops) / t_ours / 1e9,
           "breakdown_ms": parts}
    say(f"  block H{h} nh{c.n_heads} nkv{c.n_kv_heads} F{f} B{b} T{t}: ours {t_ours:.3f} ms, transformers "
        f"eager {t_hf:.3f} ms (ours x{t_ours / t_hf:.2f} its time), sdpa {t_sdpa:.3f} ms (x{t_ours / t_sdpa:.2f});"
        f" err {err:.1e} / {err_sdpa:.1e}  (goal: at most x1.20)")
    for k, v in parts.items():
        say(f"    {k:<14} {v:8.3f} ms")
    return rec


def bench_block_bf16(c: LlamaBlockConfig, b: int, t: int) -> dict:
    """The block with ``dtype="bfloat16"`` against the transformers layer in bf16 (eager with a mask,
    and SDPA): times, and the errors of Note [bf16 noise] (``truth``: the layer in fp32 on the same
    bf16 weights and input)."""
    import dataclasses

    c = dataclasses.replace(c, dtype="bfloat16")
    layer, rot = hf_layer(c, 0)
    layer = layer.bfloat16()
    sd = {k: v.detach().contiguous() for k, v in layer.state_dict().items()}  # bf16
    x = torch.randn(b, t, c.hidden_size, device="cuda").bfloat16()
    out = torch.empty_like(x)
    blk = LlamaBlock(sd, c, b, t)
    dx, dout = cuda.as_cuda_array(x.view(torch.int16)), cuda.as_cuda_array(out.view(torch.int16))

    hf, t_hf, t_sdpa, t_ours = time_blocks(layer, rot, x, blk, dx, dout)
    cuda.synchronize()
    want = {attn: hf(attn) for attn in ("eager", "sdpa")}
    with torch.no_grad():
        truth = hf_forward(layer.float(), rot, x.float(), "eager")
    layer.bfloat16()
    rec = {"config": c.__dict__, "batch": b, "seq": t, "ours_ms": t_ours, "transformers_eager_ms": t_hf,
           "transformers_sdpa_ms": t_sdpa, "ratio_to_transformers_eager": t_ours / t_hf,
           "ratio_to_transformers_sdpa": t_ours / t_sdpa, "rel_err_ours_vs_fp32": rel(out.float(), truth)}
    for attn, w in want.items():
        rec[f"rel_err_vs_transformers_{attn}"] = rel(out.float(), w.float())
        rec[f"rel_err_transformers_{attn}_vs_fp32"] = rel(w.float(), truth)
    say(f"  bf16 block H{c.hidden_size} nh{c.n_heads} nkv{c.n_kv_heads} F{c.ffn_size} B{b} T{t}: ours {t_ours:.3f} ms, "
        f"transformers eager {t_hf:.3f} ms (x{t_ours / t_hf:.2f}), sdpa {t_sdpa:.3f} ms (x{t_ours / t_sdpa:.2f}); "
        f"err vs fp32 ours {rec['rel_err_ours_vs_fp32']:.2e}, HF eager {rec['rel_err_transformers_eager_vs_fp32']:.2e}, "
        f"HF sdpa {rec['rel_err_transformers_sdpa_vs_fp32']:.2e}")
    return rec


# ---- 5. RMSNorm backward ----------------------------------------------------------------------

# The launcher's tiles first, then spans of 64 and 256 columns, fewer row lanes, no unroll.
RMS_DW_TILES = (DwTiles(), DwTiles(cols=2), DwTiles(cols=8), DwTiles(row_lanes=8, rows=32), DwTiles(unroll=1))


def bench_rmsnorm_backward(shapes=((2048, 4096), (256, 4096)), eps: float = 1e-5) -> list[dict]:
    rows = []
    for r, h in shapes:
        x = torch.randn(r, h, device="cuda", requires_grad=True)  # (R, H)
        w = (1 + 0.1 * torch.randn(h, device="cuda")).requires_grad_()  # (H,)
        dy = torch.randn(r, h, device="cuda")
        (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w).backward(dy)
        nb = lambda t: cuda.as_cuda_array(t.detach())  # noqa: E731
        dx, dw, dw2 = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)
        gb = 2 * r * h * 4 / 1e9  # x and dy read once
        rec = {"R": r, "H": h, "dx_ms": time_numba(lambda: rmsnorm_backward_dx(nb(x), nb(w), nb(dy), nb(dx), eps), 20)}
        rec["dx_rel_err"] = rel(dx, x.grad)
        say(f"  R{r} H{h}: dx {rec['dx_ms']:.4f} ms ({gb / rec['dx_ms'] * 1e3:.0f} GB/s), err {rec['dx_rel_err']:.1e}")
        rec["dw"] = []
        for t in RMS_DW_TILES:
            def run(t=t, out=dw):
                rmsnorm_backward_dw(nb(x), nb(dy), nb(out), eps, tiles=t)
            try:
                ms = time_numba(run, 20)
            except Exception as e:  # a tile shape that does not compile or launch: say so, go on
                rec["dw"].append({"tiles": t.__dict__, "error": f"{type(e).__name__}: {e}"[:300]})
                say(f"    dw {t}: {rec['dw'][-1]['error']}")
                continue
            run(out=dw2)
            cuda.synchronize()
            d = {"tiles": t.__dict__, "ms": ms, "gb_per_s": gb / ms * 1e3, "rel_err": rel(dw, w.grad),
                 "same_bits_twice": bool(torch.equal(dw, dw2))}
            rec["dw"].append(d)
            say(f"    dw {t}: {ms:.4f} ms ({d['gb_per_s']:.0f} GB/s), err {d['rel_err']:.1e}, "
                f"same bits twice {d['same_bits_twice']}")
        rows.append(rec)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", nargs="+", choices=("all", "correctness", "gemm", "attention", "attention_bf16", "block", "block_bf16",
                                                        "rmsnorm"),
                    default=["all"], help="run these sections only (e.g. --only gemm block)")
    args = ap.parse_args()
    run = lambda section: "all" in args.only or section in args.only  # noqa: E731
    if not torch.cuda.is_available():
        say("kernels_bench: no CUDA GPU here, nothing to measure")
        return
    tf32_off()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    import numba
    import transformers

    RESULTS["env"] = run_env(transformers=transformers.__version__)
    say(f"== {dev}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"numba {numba.__version__}, TF32 {torch.backends.cuda.matmul.allow_tf32}")

    if run("correctness"):
        section_correctness(t0)
    if run("gemm"):
        section_gemm(t0)
    if run("attention"):
        say(f"== 3. causal GQA attention, fp32, vs torch SDPA (B, nh, nkv, hd) = {ATT_SHAPE}")
        RESULTS["attention"] = bench_attention()
        say(f"  ({time.time() - t0:.0f} s)")
    if run("attention_bf16"):
        say(f"== 3b. causal GQA flash attention, bf16, vs torch SDPA flash/efficient (B, nh, nkv) = {ATT_BF16_SHAPE}")
        RESULTS["attention_bf16"] = bench_attention_bf16()
        say(f"  ({time.time() - t0:.0f} s)")
    if run("block"):
        say("== 4. whole block, fp32, vs transformers LlamaDecoderLayer (eager and sdpa)")
        RESULTS["block"] = [bench_block(c, 1, t) for c, t in BLOCK_SHAPES]
        say(f"  ({time.time() - t0:.0f} s)")
    if run("block_bf16"):
        say("== 4b. whole block, bf16, vs transformers LlamaDecoderLayer in bf16 (eager and sdpa)")
        RESULTS["block_bf16"] = [bench_block_bf16(c, 1, t) for c, t in BLOCK_SHAPES]
        say(f"  ({time.time() - t0:.0f} s)")
    if run("rmsnorm"):
        say("== 5. RMSNorm backward, fp32, vs torch.autograd")
        RESULTS["rmsnorm_backward"] = bench_rmsnorm_backward()
        say(f"  ({time.time() - t0:.0f} s)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_bench.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    say(f"wrote {out / 'kernels_bench.json'} ({time.time() - t0:.0f} s)")


def section_correctness(t0: float) -> None:
    say("== 1. correctness: Numba block vs transformers LlamaDecoderLayer (fp32, eager)")
    RESULTS["block_correctness"] = []
    for nkv in (16, 4):
        c = LlamaBlockConfig(hidden_size=2048, n_heads=16, n_kv_heads=nkv, ffn_size=5632)
        rec = check_block(c, 1, 1024)
        RESULTS["block_correctness"].append(rec)
        say(f"  H2048 nh16 nkv{nkv} F5632 T1024: rel err vs transformers "
            f"{rec['rel_err_vs_transformers']:.2e} (device path {rec['rel_err_device_path_vs_transformers']:.2e}),"
            f" vs numpy ref {rec['rel_err_vs_numpy_reference']:.2e}, numpy ref vs transformers "
            f"{rec['rel_err_numpy_reference_vs_transformers']:.2e}  -> {'PASS' if rec['pass_1e-4'] else 'FAIL'}")
    say(f"  ({time.time() - t0:.0f} s)")


def section_gemm(t0: float) -> None:
    say("== 2. GEMM y = x @ w.T, fp32, vs cuBLAS (torch.matmul, TF32 off)")
    shapes = [("4096^3", (4096, 4096, 4096)),
              ("q/o proj 1024x2048x2048", (1024, 2048, 2048)),
              ("kv proj(gqa4) 1024x512x2048", (1024, 512, 2048)),
              ("gate/up 1024x5632x2048", (1024, 5632, 2048)),
              ("down 1024x2048x5632", (1024, 2048, 5632))]
    RESULTS["gemm"] = bench_gemm(shapes)
    say(f"  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
