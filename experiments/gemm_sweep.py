"""GEMM sweep on a real GPU: Numba variants x tile shapes against cuBLAS fp32, in one run.

For each candidate (variant, tile shape) and each shape (4096^3 and the LLaMA block's GEMMs at
1024 tokens) prints and records the median time, TFLOP/s, the percentage of cuBLAS fp32
(torch.matmul, TF32 off, timed in the same run) and the max relative error against it
(max |ours - cuBLAS| / max |cuBLAS|). A ragged shape (no dimension a multiple of a tile) checks
the bounds-checked paths on the hardware. Also records registers and local memory per thread
of every kernel, as compiled on this machine.

Timing: CUDA events around REPS back-to-back launches (so the ~10-30 us host cost of a Numba
launch overlaps the kernels instead of being timed), median over SAMPLES such batches, after
warmup; cuBLAS is timed the same way. Budget: ~10 kernel builds of 1-5 s each, well within
4 minutes on an H200.

    python3 experiments/gemm_sweep.py --out DIR      # writes DIR/gemm_sweep.json
    python3 experiments/gemm_sweep.py --out DIR --quick   # 4096^3 and one block shape only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from numba import cuda

from common import run_env, say, tf32_off, time_events
from vmstoolkit.kernels import gemm as G

SHAPES = [  # (name, (M, N, K)): y (M, N) = x (M, K) @ w (N, K).T
    ("4096^3", (4096, 4096, 4096)),
    ("q/o proj 1024x2048x2048", (1024, 2048, 2048)),
    ("kv proj(gqa4) 1024x512x2048", (1024, 512, 2048)),
    ("gate/up 1024x5632x2048", (1024, 5632, 2048)),
    ("down 1024x2048x5632", (1024, 2048, 5632)),
]
RAGGED = ("ragged 1001x517x1027", (1001, 517, 1027))  # correctness of the edge paths only

T = G.GemmTiles
CANDIDATES = [  # (variant, tiles); the first two are the launcher's current (v1) choices
    (1, T(64, 128, 8, 4, 8)),
    (1, T(64, 64, 16, 4, 4)),
    (3, T(128, 128, 8, 8, 8)),
    (4, T(128, 128, 8, 8, 8)),
    (4, T(128, 128, 16, 8, 8)),
    (3, T(64, 128, 8, 4, 8)),
    (3, T(128, 64, 8, 8, 4)),
    (3, T(64, 64, 16, 4, 4)),
    (3, T(64, 64, 32, 4, 4)),
    (3, T(64, 64, 16, 4, 4), 2),  # split-K (v3, v4 only): 2 to 4 blocks per output tile
    (3, T(64, 64, 16, 4, 4), 3),
    (3, T(64, 64, 16, 4, 4), 4),
    (None, None, None),  # the launcher's choice (gemm.choose)
]
REPS = 5  # launches per timed batch
SAMPLES = 7  # batches; the median is reported


def label(v, t, splits=None) -> str:
    if v is None:
        return "auto"
    return f"v{v} {t.bm}x{t.bn}x{t.bk}/{t.tm}x{t.tn}" + (f" split{splits}" if splits else "")


def time_batched(launch, events: str) -> float:
    """Median milliseconds per call of ``launch()``, by CUDA events around REPS calls, SAMPLES times."""
    return time_events(launch, SAMPLES, warmup=3, per_event=REPS, events=events)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def kernel_resources(v: int, t: G.GemmTiles) -> dict:
    """Registers and local memory (spills) per thread of the compiled kernel, if Numba says."""
    k = G.get_kernel(v, t)
    out = {}
    for key, fn in (("regs", "get_regs_per_thread"), ("local_bytes", "get_local_mem_per_thread")):
        try:
            r = getattr(k, fn)()
            out[key] = int(next(iter(r.values()))) if isinstance(r, dict) else int(r)
        except Exception as e:  # noqa: BLE001 - informative only
            out[key] = f"n/a ({type(e).__name__})"
    return out


def run_shape(name: str, m: int, n: int, k: int, candidates, time_it: bool = True) -> list[dict]:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)  # (M, K)
    w = torch.randn(n, k, device="cuda", generator=g)  # (N, K)
    y = torch.empty(m, n, device="cuda")  # (M, N)
    want = torch.matmul(x, w.T)  # (M, N), cuBLAS fp32
    flops = 2.0 * m * n * k
    t_cublas = time_batched(lambda: torch.matmul(x, w.T, out=y), "torch") if time_it else float("nan")
    if time_it:
        say(f"  {name:<28} {'cuBLAS fp32':<22} {flops / t_cublas / 1e9:6.2f} TFLOP/s"
            f"  {t_cublas:8.4f} ms")
    dx, dw, dy = cuda.as_cuda_array(x), cuda.as_cuda_array(w), cuda.as_cuda_array(y)
    rows = []
    for cand in candidates:
        v, t, splits = (tuple(cand) + (None,))[:3]
        lab = label(v, t, splits)
        if v is None:  # the launcher's choice, recorded as what it ran
            auto = G.choose(m, n, k)
            v, t, splits = auto.variant, auto.tiles, auto.splits
            lab = "auto = " + label(v, t, splits if splits > 1 else None)
        try:
            y.fill_(float("nan"))
            G.gemm(dx, dw, dy, tiles=t, variant=v, splits=splits)
            cuda.synchronize()
            err = rel_err(y, want)
            ms = (time_batched(lambda: G.gemm(dx, dw, dy, tiles=t, variant=v, splits=splits), "numba")
                  if time_it else float("nan"))
        except Exception as e:  # noqa: BLE001 - keep the sweep going, record the failure
            say(f"  {name:<28} {lab:<22} FAILED: {type(e).__name__}: {e}")
            rows.append({"shape": name, "M": m, "N": n, "K": k, "config": lab, "variant": v,
                         "tiles": t.__dict__, "error": f"{type(e).__name__}: {e}"})
            continue
        r = {"shape": name, "M": m, "N": n, "K": k, "config": lab, "variant": v,
             "tiles": t.__dict__, "ms": ms, "tflops": flops / ms / 1e9, "cublas_ms": t_cublas,
             "cublas_tflops": flops / t_cublas / 1e9, "pct_of_cublas": 100 * t_cublas / ms,
             "rel_err_vs_cublas": err, "splits": splits or 1,
             "blocks": -(-m // t.bm) * -(-n // t.bn) * (splits or 1)}
        rows.append(r)
        ok = "" if err <= 1e-5 else "  <-- ERROR > 1e-5"
        if time_it:
            say(f"  {name:<28} {lab:<22} {r['tflops']:6.2f} TFLOP/s  {ms:8.4f} ms"
                f"  {r['pct_of_cublas']:5.1f}% of cuBLAS  err {err:.1e}  {r['blocks']} blocks{ok}")
        else:
            say(f"  {name:<28} {lab:<22} err {err:.1e}{ok}")
    return rows


def summary(rows: list[dict]) -> dict:
    """Best candidate per shape, and per candidate its worst percentage over the shapes."""
    timed = [r for r in rows if "ms" in r and r["ms"] == r["ms"]]
    best = {}
    for r in timed:
        if r["shape"] not in best or r["ms"] < best[r["shape"]]["ms"]:
            best[r["shape"]] = r
    worst = {}
    for r in timed:
        worst[r["config"]] = min(worst.get(r["config"], 1e9), r["pct_of_cublas"])
    return {"best_per_shape": {s: {"config": r["config"], "tflops": r["tflops"],
                                   "pct_of_cublas": r["pct_of_cublas"]} for s, r in best.items()},
            "worst_pct_per_config": worst}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="4096^3 and the q/o shape only")
    args = ap.parse_args()
    tf32_off()
    t0 = time.time()
    import numba

    dev = torch.cuda.get_device_name()
    res = {"env": run_env(reps=REPS, samples=SAMPLES)}
    say(f"== {dev}, torch {torch.__version__}, numba {numba.__version__}, "
        f"TF32 {torch.backends.cuda.matmul.allow_tf32}")

    say("== build: registers / local memory per thread")
    res["kernels"] = {}
    for v, t in dict.fromkeys((c[0], c[1]) for c in CANDIDATES if c[0] is not None):
        t1 = time.time()
        # compile by launching once on a tiny problem (the signature the sweep uses)
        run_shape("warmup 8x8x8", 8, 8, 8, [(v, t)], time_it=False)
        info = kernel_resources(v, t)
        res["kernels"][label(v, t)] = {**info, "build_s": time.time() - t1}
        say(f"  {label(v, t):<22} regs {info['regs']}, local {info['local_bytes']} B"
            f"  ({time.time() - t1:.1f} s)")

    say("== ragged shape, correctness only")
    res["ragged"] = run_shape(RAGGED[0], *RAGGED[1], CANDIDATES, time_it=False)

    say(f"== GEMM y = x @ w.T fp32, vs cuBLAS (TF32 off); events around {REPS} launches, "
        f"median of {SAMPLES}")
    shapes = SHAPES[:2] if args.quick else SHAPES
    res["gemm"] = []
    for name, (m, n, k) in shapes:
        res["gemm"] += run_shape(name, m, n, k, CANDIDATES)
        say(f"  ({time.time() - t0:.0f} s)")

    res["summary"] = summary(res["gemm"])
    say("== best per shape")
    for s, b in res["summary"]["best_per_shape"].items():
        say(f"  {s:<28} {b['config']:<22} {b['tflops']:6.2f} TFLOP/s  {b['pct_of_cublas']:5.1f}%")
    say("== worst % of cuBLAS over the shapes, per candidate")
    for c, p in sorted(res["summary"]["worst_pct_per_config"].items(), key=lambda kv: -kv[1]):
        say(f"  {c:<22} {p:5.1f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    say(f"wrote {out / 'gemm_sweep.json'} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
