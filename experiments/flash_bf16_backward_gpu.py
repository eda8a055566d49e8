"""The bf16 flash-attention backward on a real GPU, kernel by kernel and tile by tile (issue 33, item 3).

For causal GQA at batch 1, 32 query heads and 8 key/value heads (the shape of ``kernels_bench.py
--only attention_bf16``), head dims 64 and 128, T 1024-8192: SDPA flash's backward
(``autograd.grad`` of its output, the forward not timed), then each of our backward's launches
(``flash_bf16.backward_launches``: dsum, dQ, dK/dV) timed alone, GPU time only (``time_held``), for
every candidate tile of the dQ kernel and of the dK/dV kernel. A tile's launch that fails to build
or launch is recorded and skipped. ``best`` = dsum + the fastest dQ + the fastest dK/dV at that
shape; ``default`` = the three launches with the default tiles; both over SDPA flash's time (goal
at most 1.30). Then the fused backward (one kernel for dK, dV and dQ, ``fused=True``) on each of
its candidate tiles (``+split``: a block per query head, ``split_heads=True``), with its small
launches (dsum and the accumulators' zeroing, the conversions), each timed alone and summed. The best pair is checked against SDPA's gradients (largest difference over the
largest value). One JSON line per shape goes to ``<out>/flash_bwd.jsonl`` as it is measured, so a
run cut short keeps its rows.

    python3 experiments/flash_bf16_backward_gpu.py --out DIR [--hd 64 128] [--t 1024 2048 4096 8192]

Compiling is most of its time (about 20 s a kernel). With ``VMSTOOLKIT_CUDA_CACHE=1`` the kernels
can be built first by parallel processes, each ``--compile-only`` with one tile (at T = 128, nothing
timed), and the timing run then loads them from the cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch
from common import run_env, say, time_held

# the candidates after the first sweep (results/kernels-h200/run14-flash-bwd-h100): the others lost at every shape
DQ_TILES = ("w4/kv64",)
DKV_TILES = ("w4/kv64",)
FUSED_TILES = ("w4/kv64", "w4/kv64+split", "w8/kv64+split", "w4/kv32+split")
SHAPE = (1, 32, 8)  # (B, nh, nkv)


def parse_tiles(label: str):
    from vmstoolkit.kernels import flash_bf16 as FB

    w, kv = label.split("/")
    return FB.FlashBf16Tiles(warps=int(w[1:]), bkv=int(kv[2:]))


def sdpa_backward_ms(q, k, v, do, reps) -> tuple[float, list]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]  # (B, n, T, hd)
    doh = do.transpose(1, 2).contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    want = [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, doh, retain_graph=True)]
    ms = time_held(lambda: torch.autograd.grad(out, leaves, doh, retain_graph=True), reps)["best_ms"]
    return ms, want


def bench(hd: int, t: int, dq_tiles, dkv_tiles, fused_tiles) -> dict:
    from numba import cuda

    from vmstoolkit.kernels import flash_bf16 as FB

    b, nh, nkv = SHAPE
    g = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(b, t, nh, hd, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, t, nkv, hd, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, t, nkv, hd, device="cuda", generator=g).bfloat16()
    do = torch.randn(b, t, nh, hd, device="cuda", generator=g).bfloat16()
    flops = 2.5 * 4.0 * b * nh * hd * t * (t + 1) / 2
    reps = max(2, 4 * 8192 // t)
    sdpa_ms, want = sdpa_backward_ms(q, k, v, do, reps)
    o, lse = torch.empty_like(q), torch.empty(b, nh, t, device="cuda")
    grads = [torch.empty_like(x) for x in (q, k, v)]
    nb = lambda x: cuda.as_cuda_array(x.view(torch.int16) if x.dtype == torch.bfloat16 else x)  # noqa: E731
    FB.flash_attention_bf16(nb(q), nb(k), nb(v), nb(o), lse=nb(lse))
    dsum = cuda.device_array((b, nh, t), np.float32)
    args = [nb(x) for x in (q, k, v, o, lse, do, *grads)]
    rec = {"hd": hd, "T": t, "B": b, "nh": nh, "nkv": nkv, "sdpa_flash_ms": sdpa_ms, "dq": {}, "dkv": {}, "fused": {}}
    dqa = cuda.device_array((b, t, nh, hd), np.float32)
    say(f"hd{hd} T{t}: SDPA flash backward {sdpa_ms:.3f} ms ({flops / sdpa_ms / 1e9:.0f} TFLOP/s)")
    for part, cands in (("dq", dq_tiles), ("dkv", dkv_tiles)):
        for label in cands:
            kw = {"tiles": parse_tiles(label)} if part == "dq" else {"dkv_tiles": parse_tiles(label)}
            try:
                launches = dict(FB.backward_launches(*args, dsum=dsum, **kw))
                for name in ("dsum", "dq", "dkv"):
                    launches[name]()
                cuda.synchronize()
                rec[part][label] = time_held(launches[part], reps)["best_ms"]
                if "dsum_ms" not in rec:
                    rec["dsum_ms"] = time_held(launches["dsum"], reps)["best_ms"]
            except Exception as e:  # noqa: BLE001 - a tile that does not build or launch: record it, go on
                rec[part][label] = None
                rec.setdefault("errors", {})[f"{part} {label}"] = f"{type(e).__name__}: {e}"[:400]
                say(f"  {part} {label}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            say(f"  {part} {label:>8}: {rec[part][label]:.3f} ms")
    for label in fused_tiles:
        tl, split = label.split("+")[0], label.endswith("+split")
        try:
            launches = FB.backward_launches(*args, dsum=dsum, dkv_tiles=parse_tiles(tl), fused=True, dq_accum=dqa,
                                            split_heads=split)
            for _, fn in launches:
                fn()
            cuda.synchronize()
            each = {name: time_held(fn, reps)["best_ms"] for name, fn in launches}
            rec["fused"][label] = each["dkvq"]
            total = sum(each.values())
            rec.setdefault("fused_total_ms", {})[label] = total
            rec.setdefault("fused_launch_ms", {})[label] = each
            for _, fn in launches:  # once more in order: the timed repeats add into the accumulators again
                fn()
            cuda.synchronize()
            errs = {n: float((a.float() - w.float()).abs().max() / w.float().abs().max())
                    for n, a, w in zip(("dq", "dk", "dv"), grads, want)}
            rec.setdefault("fused_err", {})[label] = errs
        except Exception as e:  # noqa: BLE001 - a tile that does not build or launch: record it, go on
            rec["fused"][label] = None
            rec.setdefault("errors", {})[f"fused {label}"] = f"{type(e).__name__}: {e}"[:400]
            say(f"  fused {label}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        say(f"  fused {label:>14}: kernel {each['dkvq']:.3f} ms, whole backward {total:.3f} ms = x{total / sdpa_ms:.2f} "
            "SDPA flash; err " + " ".join(f"{n} {x:.1e}" for n, x in errs.items()))
    fused_ok = rec.get("fused_total_ms", {})
    if fused_ok:
        lab = min(fused_ok, key=fused_ok.get)
        rec.update(fused_best_tiles=lab, fused_best_ms=fused_ok[lab])
        rec["fused_best_ratio"] = rec["fused_best_ms"] / sdpa_ms
    timed = {p: {lab: ms for lab, ms in rec[p].items() if ms is not None} for p in ("dq", "dkv")}
    if timed["dq"] and timed["dkv"]:
        best = {p: min(timed[p], key=timed[p].get) for p in ("dq", "dkv")}
        total = rec["dsum_ms"] + sum(timed[p][best[p]] for p in best)
        rec.update(best_tiles=best, best_ms=total, best_ratio=total / sdpa_ms, best_tflops=flops / total / 1e9)
        d0 = DQ_TILES[0]
        if d0 in timed["dq"] and d0 in timed["dkv"]:
            rec["default_ms"] = rec["dsum_ms"] + timed["dq"][d0] + timed["dkv"][d0]
            rec["default_ratio"] = rec["default_ms"] / sdpa_ms
        FB.flash_attention_bf16_backward(*args, dsum=dsum, tiles=parse_tiles(best["dq"]),
                                         dkv_tiles=parse_tiles(best["dkv"]))
        cuda.synchronize()
        rec["rel_err"] = {n: float((a.float() - w.float()).abs().max() / w.float().abs().max())
                          for n, a, w in zip(("dq", "dk", "dv"), grads, want)}
        say(f"  best dq {best['dq']} + dkv {best['dkv']}: {total:.3f} ms = x{rec['best_ratio']:.2f} SDPA flash"
            f" (default x{rec.get('default_ratio', float('nan')):.2f}); err "
            + " ".join(f"{n} {e:.1e}" for n, e in rec["rel_err"].items()))
    return rec


def compile_only(hds, dq_tiles, dkv_tiles, fused_tiles) -> None:
    from numba import cuda

    from vmstoolkit.kernels import flash_bf16 as FB

    b, nh, nkv = SHAPE
    for hd in hds:
        q, do = (torch.zeros(b, 128, nh, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.zeros(b, 128, nkv, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o, lse = torch.zeros_like(q), torch.zeros(b, nh, 128, device="cuda")
        nb = lambda x: cuda.as_cuda_array(x.view(torch.int16) if x.dtype == torch.bfloat16 else x)  # noqa: E731
        args = [nb(x) for x in (q, k, v, o, lse, do, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))]
        FB.flash_attention_bf16(*(nb(x) for x in (q, k, v, o)), lse=nb(lse))
        pairs = itertools.zip_longest(dq_tiles, dkv_tiles, fillvalue=(dq_tiles or dkv_tiles)[0])
        kws = ([{"tiles": parse_tiles(x), "dkv_tiles": parse_tiles(y)} for x, y in pairs]
               + [{"dkv_tiles": parse_tiles(x.split("+")[0]), "fused": True, "split_heads": x.endswith("+split")}
                  for x in fused_tiles])
        for kw in kws:
            FB.flash_attention_bf16_backward(*args, **kw)
        cuda.synchronize()
        say(f"compiled hd{hd}: {dq_tiles} {dkv_tiles} {fused_tiles}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--t", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--dq-tiles", nargs="+", default=list(DQ_TILES))
    ap.add_argument("--dkv-tiles", nargs="+", default=list(DKV_TILES))
    ap.add_argument("--fused-tiles", nargs="+", default=list(FUSED_TILES))
    ap.add_argument("--compile-only", action="store_true", help="build (and cache) the candidates' kernels, time nothing")
    a = ap.parse_args()
    if a.compile_only:
        compile_only(a.hd, a.dq_tiles, a.dkv_tiles, a.fused_tiles)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "env.json").write_text(json.dumps(run_env(), indent=1))
    rows = []
    with open(a.out / "flash_bwd.jsonl", "a") as f:
        for hd in a.hd:
            for t in a.t:
                rows.append(bench(hd, t, a.dq_tiles, a.dkv_tiles, a.fused_tiles))
                f.write(json.dumps(rows[-1]) + "\n")
                f.flush()
                torch.cuda.empty_cache()
    say("time / SDPA flash backward's (goal <= 1.30)")
    say("hd     T  SDPA ms  default  best two  (dq, dkv tiles)     best fused (tiles)")
    nan = float("nan")
    for r in rows:
        two = f"{r['best_ratio']:8.2f}  ({r['best_tiles']['dq']}, {r['best_tiles']['dkv']})" if "best_ms" in r else " " * 28
        say(f"{r['hd']:>3} {r['T']:>5} {r['sdpa_flash_ms']:8.3f} {r.get('default_ratio', nan):7.2f} {two:<30} "
            f"{r.get('fused_best_ratio', nan):6.2f} ({r.get('fused_best_tiles', '-')})")


if __name__ == "__main__":
    main()
