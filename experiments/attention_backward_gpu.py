"""Attention backward on a real GPU: variant 1 (one row per thread) against variant 2
(register-blocked, ``FlashBackwardTiles``) and PyTorch's SDPA backward, fp32 causal GQA at
batch 1, 32 heads of 128, 8 key/value heads, T = 1024, 2048, 4096 (``--t``).

For each T: milliseconds (best of 5 batches of back-to-back launches, CUDA events), TFLOP/s
(the backward's 5 T^2/2 hd nh multiply-adds: S and dP recomputed, dV, dK, dQ), the time over
SDPA's backward (``torch.autograd.grad`` of SDPA, forward excluded: its saved tensors are
reused) and each variant's largest relative difference to SDPA's gradients.
Writes ``<out>/attention_backward.json``. Under a minute on an H200.

    python3 experiments/attention_backward_gpu.py --out DIR
    python3 experiments/attention_backward_gpu.py --out DIR --tiles 16/4/16/2/2/4/16/16/2/2/4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import run_env, say, tf32_off, time_best

from vmstoolkit.kernels import attention_backward as AB
from vmstoolkit.kernels.attention import attention


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def bench(t: int, tiles: list, nh: int = 32, nkv: int = 8, hd: int = 128) -> dict:
    from numba import cuda

    torch.manual_seed(0)
    q = torch.randn(1, t, nh, hd, device="cuda", requires_grad=True)  # (B, T, nh, hd)
    k = torch.randn(1, t, nkv, hd, device="cuda", requires_grad=True)  # (B, T, nkv, hd)
    v = torch.randn(1, t, nkv, hd, device="cuda", requires_grad=True)
    do = torch.randn(1, t, nh, hd, device="cuda")
    g = nh // nkv
    qh, kh, vh = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    o_ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    doh = do.transpose(1, 2)
    want = torch.autograd.grad(o_ref, (q, k, v), doh, retain_graph=True)
    sdpa_ms, _ = time_best(lambda: torch.autograd.grad(o_ref, (q, k, v), doh, retain_graph=True), 3, events="torch")
    nb = lambda x: cuda.as_cuda_array(x.detach())  # noqa: E731
    o = torch.empty(1, t, nh, hd, device="cuda")
    lse = torch.empty(1, nh, t, device="cuda")
    attention(nb(q), nb(k), nb(v), nb(o), lse=nb(lse))
    grads = [torch.empty_like(x) for x in (q, k, v)]
    flops = 2 * 5 * t * t / 2 * hd * nh
    rec = {"T": t, "nh": nh, "nkv": nkv, "hd": hd, "sdpa_backward_ms": sdpa_ms, "runs": {}}
    say(f"T={t}: SDPA backward {sdpa_ms:.3f} ms ({flops / sdpa_ms / 1e9:.1f} TFLOP/s)")
    for label, kw in [("variant 1", {"variant": 1}), *((f"variant 2 {x}", {"variant": 2, "tiles": x}) for x in tiles)]:
        def run(kw=kw):
            AB.attention_backward(nb(q), nb(k), nb(v), nb(o), nb(lse), nb(do), *map(nb, grads), **kw)
        try:
            ms, _ = time_best(run, 3)
        except Exception as e:  # a tile shape that does not compile or launch: say so, go on
            rec["runs"][label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            say(f"  {label:<50} {rec['runs'][label]['error']}")
            continue
        err = max(rel(a, b) for a, b in zip(grads, want))
        rec["runs"][label] = {"ms": ms, "tflops": flops / ms / 1e9, "ratio_to_sdpa": ms / sdpa_ms, "rel_err": err}
        say(f"  {label:<50} {ms:9.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  x{ms / sdpa_ms:5.2f} SDPA's  err {err:.1e}")
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--t", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--tiles", nargs="+", default=[], help="variant 2 tiles rows/heads/bkv/tr/tk/to/keys/bq/tkk/tq/tko "
                    "(default: FlashBackwardTiles() and FLASH_BACKWARD_CANDIDATES)")
    a = ap.parse_args()
    tf32_off()
    tiles = [AB.FlashBackwardTiles.parse(x) for x in a.tiles] or [AB.FlashBackwardTiles(), *AB.FLASH_BACKWARD_CANDIDATES]
    recs = [bench(t, tiles) for t in a.t]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "attention_backward.json").write_text(json.dumps({"env": run_env(), "results": recs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
