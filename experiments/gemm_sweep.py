"""GEMM sweep on a real GPU: Numba candidates x shapes against cuBLAS fp32, side by side in one run.

Shapes (``--set 7b``, the default: the runtime's LLaMA-2-7B-wide block at 2048 tokens, 32 heads
of 128, GQA with 8 key/value heads): 4096^3, the block's forward GEMMs y = x w^T (q/o, which is
also k/v without GQA; k/v with GQA; gate/up; down), and the backward's transposed GEMMs
dx = dy w and dw = dy^T x of each (and of 4096^3). ``--set 1b`` takes the earlier 2048-wide,
1024-token shapes of experiments/results/gemm-h200/ instead; ``--set lora`` LoRA's rank-16 GEMMs
(forward and backward) on the 7B block's projections, with the "skinny" rule's candidates.

For each shape and candidate (variant, tile shape, split-K; and the choices of the launch rules:
"proposed", ``gemm.choose(rule="proposed")``, every layout's, and for outputs 16 wide "skinny")
prints the time, TFLOP/s, the percentage of cuBLAS fp32 (torch.matmul, TF32 off, timed in the
same run) and the max relative error against it (max |ours - cuBLAS| / max |cuBLAS|); then one
summary line per shape (cuBLAS, the proposed rule and the best candidate) and a table of every
candidate's % of cuBLAS per shape. A ragged problem
per layout (no dimension a multiple of a tile) checks every candidate's bounds-checked paths on
the hardware first, which also compiles it; registers and local memory per thread are printed.

Timing (``--timing``): "held" (the default since sweep 8) enqueues each batch of REPS back-to-back
launches behind a GPU spin, so that every launch is queued before the first CUDA event is reached
(``common.time_held``; NVBench's blocking kernel): the events time the GPU's work alone, and the
host's cost per launch is recorded beside it (``host_ms``). "plain" (sweeps 1-7) records the first
event right before the launches, so the first launch's host cost (a Numba launch's 10-100 us
against cuBLAS's few) is in the batch: 2-5% of a 0.4 ms kernel's time. "both" times each launch
both ways. The best of SAMPLES batches, after warm-up (the median is in the JSON too); cuBLAS is
timed the same way. Time-bounded: shapes run
in the order above and whatever is left when ``--budget-s`` (default 270 s) has passed is
skipped and listed; sweep 6 (3-4 candidates, 15 shapes) took 103 s on an H200.

    python3 experiments/gemm_sweep.py --out DIR            # writes DIR/gemm_sweep.json
    python3 experiments/gemm_sweep.py --out DIR --quick    # forward shapes only
    python3 experiments/gemm_sweep.py --out DIR --kinds dx dw  # the backward layouts only
    python3 experiments/gemm_sweep.py --out DIR --set lora # LoRA's skinny GEMMs
    python3 experiments/gemm_sweep.py --out DIR --quick --splits 1 2 3 4  # split k against wave tails
    python3 experiments/gemm_sweep.py --out DIR --kinds dx --shapes 'k/v' --variants 5 11  # two variants, one shape
    python3 experiments/gemm_sweep.py --out DIR --dtype bf16   # the tensor-core GEMM against cuBLAS bf16
    python3 experiments/gemm_sweep.py --out DIR --dtype bf16 --wgmma   # the wgmma kernel's tiles instead
    python3 experiments/gemm_sweep.py --out DIR --dtype tf32   # tf32 / 3xtf32 against cuBLAS TF32 and fp32

``--dtype bf16`` (``gemm_bf16_sweep.json``): the same shapes and held timing, bf16 operands;
cuBLAS is torch.matmul on bf16 tensors (bf16 out, fp32 accumulate); our candidates are
``gemm_bf16``'s rule with a bf16 output (the like-for-like figure), with a float32 output (split k
where the rule splits), and the other tile shapes of ``BF16_TILES``. Each candidate's error is
against a float64 product of the same bf16 operands (max |ours - ref| / max |ref|); cuBLAS's is
printed beside it.

``--dtype tf32`` (``gemm_tf32_sweep.json``): the same shapes and held timing, float32 operands;
two cuBLAS baselines, torch.matmul with ``allow_tf32=True`` (cuBLAS TF32) and with TF32 off
(cuBLAS fp32); our candidates are ``gemm_tf32``'s rule with precision "tf32" and "3xtf32" and the
other tile shapes of ``TF32_TILES``. Each row has its time as a % of both baselines and its
error against a float64 product (cuBLAS TF32's and fp32's errors printed beside); two tables, %
of cuBLAS TF32 and % of cuBLAS fp32.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from numba import cuda

from common import run_env, say, tf32_off, time_best, time_held

from vmstoolkit.kernels import gemm as G
from vmstoolkit.kernels import gemm_bf16 as GB
from vmstoolkit.kernels import gemm_wgmma as GW
from vmstoolkit.kernels import gemm_tf32 as GT

# (name, kind, (M, N, K)) with x (M, K), w (N, K): kind "fwd" times y = x w^T (M, N), "dx"
# dx = dy w (M, K), "dw" dw = dy^T x (N, K); all 2 M N K flops.
SETS = {
    "7b": [
        ("4096^3", "fwd", (4096, 4096, 4096)),
        ("q/o = k/v MHA 2048x4096x4096", "fwd", (2048, 4096, 4096)),
        ("k/v GQA8 2048x1024x4096", "fwd", (2048, 1024, 4096)),
        ("gate/up 2048x11008x4096", "fwd", (2048, 11008, 4096)),
        ("down 2048x4096x11008", "fwd", (2048, 4096, 11008)),
        ("dx 4096^3", "dx", (4096, 4096, 4096)),
        ("dw 4096^3", "dw", (4096, 4096, 4096)),
        ("dx q/o", "dx", (2048, 4096, 4096)),
        ("dw q/o", "dw", (2048, 4096, 4096)),
        ("dx k/v GQA8", "dx", (2048, 1024, 4096)),
        ("dw k/v GQA8", "dw", (2048, 1024, 4096)),
        ("dx gate/up", "dx", (2048, 11008, 4096)),
        ("dw gate/up", "dw", (2048, 11008, 4096)),
        ("dx down", "dx", (2048, 4096, 11008)),
        ("dw down", "dw", (2048, 4096, 11008)),
    ],
    # LoRA rank 16 on the 7B block's 4096-wide projections at 2048 tokens: y += (x A^T) B^T with
    # A (16, 4096), B (4096, 16); forward x A^T and h B^T (h = x A^T), and each one's dx and dw.
    # Each LoRA'd projection runs all six per step (7 projections x 16 blocks).
    "lora": [
        ("lora x A^T 2048x16x4096", "fwd", (2048, 16, 4096)),
        ("lora h B^T 2048x4096x16", "fwd", (2048, 4096, 16)),
        ("lora dx of x A^T: dy A", "dx", (2048, 16, 4096)),
        ("lora dw of x A^T: dy^T x", "dw", (2048, 16, 4096)),
        ("lora dx of h B^T: dy B", "dx", (2048, 4096, 16)),
        ("lora dw of h B^T: dy^T h", "dw", (2048, 4096, 16)),
    ],
    "1b": [
        ("4096^3", "fwd", (4096, 4096, 4096)),
        ("q/o proj 1024x2048x2048", "fwd", (1024, 2048, 2048)),
        ("kv proj(gqa4) 1024x512x2048", "fwd", (1024, 512, 2048)),
        ("gate/up 1024x5632x2048", "fwd", (1024, 5632, 2048)),
        ("down 1024x2048x5632", "fwd", (1024, 2048, 5632)),
        ("dx q/o", "dx", (1024, 2048, 2048)),
        ("dw q/o", "dw", (1024, 2048, 2048)),
        ("dx kv(gqa4)", "dx", (1024, 512, 2048)),
        ("dw kv(gqa4)", "dw", (1024, 512, 2048)),
        ("dx gate/up", "dx", (1024, 5632, 2048)),
        ("dw gate/up", "dw", (1024, 5632, 2048)),
        ("dx down", "dx", (1024, 2048, 5632)),
        ("dw down", "dw", (1024, 2048, 5632)),
    ],
}
RAGGED = (1001, 517, 1027)  # correctness of the edge paths only (and the builds)
# the same with rows of 16-byte multiples (N, K multiples of 4), where variant 11's 16-byte loads
# run (on RAGGED it runs its scalar twin, variant 5: gemm.loaded_variant)
RAGGED_ALIGNED = (1001, 516, 1028)
# --set lora: a ragged output 13 wide (fwd, dx) or 13 high (dw), for the skinny rule's tiles
RAGGED_SKINNY = {"fwd": (1001, 13, 1027), "dx": (1001, 1027, 13), "dw": (1027, 13, 1001)}
LAYOUT = {"fwd": "nn", "dx": "nt", "dw": "tt"}

CANDIDATES = [  # (variant, tiles[, splits]); a rule's name: that launch rule's choice
    ("proposed", None),  # the rule for outputs wider than G.SKINNY_MAX (every layout's "skinny" is it there)
    (11, G.PROPOSED_TILES),  # variant 11 on the same tiles: the control for 13's staged stores (the rule's since sweep 8)
    (5, G.PROPOSED_TILES),  # variant 5: the control for 11's 16-byte loads (the rule's from sweep 7)
]
REPS = 5  # launches per timed batch
SAMPLES = 7  # batches; the best is reported


def label(v, t, splits=None) -> str:
    if v in G.RULES:
        return v
    return f"v{v} {t.label()}" + (f" split{splits}" if splits and splits > 1 else "")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def kernel_resources(v: int, t: G.GemmTiles, layout: str) -> dict:
    """Registers and local memory (spills) per thread of the compiled kernel, if Numba says."""
    k = G.get_kernel(v, t, layout)
    out = {}
    for key, fn in (("regs", "get_regs_per_thread"), ("local_bytes", "get_local_mem_per_thread")):
        try:
            r = getattr(k, fn)()
            out[key] = int(next(iter(r.values()))) if isinstance(r, dict) else int(r)
        except Exception as e:  # noqa: BLE001 - informative only
            out[key] = f"n/a ({type(e).__name__})"
    return out


class Problem:
    """Operands of one shape and kind, our launch and cuBLAS's."""

    def __init__(self, kind: str, m: int, n: int, k: int):
        g = torch.Generator("cuda").manual_seed(0)
        self.kind, self.flops = kind, 2.0 * m * n * k
        x = torch.randn(m, k, device="cuda", generator=g)  # (M, K)
        w = torch.randn(n, k, device="cuda", generator=g)  # (N, K)
        if kind == "fwd":
            self.a, self.b = x, w
            self.out = torch.empty(m, n, device="cuda")  # (M, N)
            self.cublas = lambda: torch.matmul(x, w.T, out=self.out)
            self.ours_fn, self.dims = G.gemm, (m, n, k)
        else:
            dy = torch.randn(m, n, device="cuda", generator=g)  # (M, N)
            self.a, self.b = dy, (w if kind == "dx" else x)
            if kind == "dx":
                self.out = torch.empty(m, k, device="cuda")  # (M, K)
                self.cublas = lambda: torch.matmul(dy, w, out=self.out)
                self.ours_fn, self.dims = G.linear_dx, (m, k, n)
            else:
                self.out = torch.empty(n, k, device="cuda")  # (N, K)
                self.cublas = lambda: torch.matmul(dy.T, x, out=self.out)
                self.ours_fn, self.dims = G.linear_dw, (n, k, m)
        self.want = self.cublas().clone()
        self.da, self.db, self.dout = (cuda.as_cuda_array(t) for t in (self.a, self.b, self.out))

    def ours(self, v, t, splits):
        self.ours_fn(self.da, self.db, self.dout, tiles=t, variant=v, splits=splits)


def timed(fn, timing: str, events: str) -> dict:
    """One launch's timings: ``ms`` / ``ms_median`` by ``timing`` ("held" when "both") and with
    "held" the host's time per launch, with "both" the "plain" ones too (``plain_ms``...)."""
    out = {}
    if timing in ("held", "both"):
        h = time_held(fn, REPS, SAMPLES, 3)
        out.update(ms=h["best_ms"], ms_median=h["median_ms"], host_ms=h["host_ms"])
    if timing in ("plain", "both"):
        best, med = time_best(fn, REPS, SAMPLES, 3, events=events)
        pre = "plain_" if timing == "both" else ""
        out.update({pre + "ms": best, pre + "ms_median": med})
    return out


def run_shape(name: str, kind: str, dims, candidates, time_it: bool, deadline: float,
              timing: str = "held") -> list[dict]:
    m, n, k = dims
    row0 = {"shape": name, "kind": kind, "M": m, "N": n, "K": k}
    if time_it and time.time() > deadline:
        return [{**row0, "config": label(*c), "skipped": "time budget"} for c in candidates]
    p = Problem(kind, m, n, k)
    out_m, out_n, red = p.dims
    if time_it:
        cub = timed(p.cublas, timing, "torch")
        c_best = cub["ms"]
        host = f"  host {cub['host_ms'] * 1e3:5.1f} us/launch" if "host_ms" in cub else ""
        say(f"  {name:<30} {'cuBLAS fp32':<30} {p.flops / c_best / 1e9:6.2f} TFLOP/s  {c_best:8.4f} ms{host}")
    rows = []
    for cand in candidates:
        if time_it and time.time() > deadline:
            rows.append({**row0, "config": label(*cand), "skipped": "time budget"})
            continue
        v, t, splits = (tuple(cand) + (None,))[:3]
        rule = v if v in G.RULES else None  # a launch rule's choice, recorded as what it ran
        try:
            launch = G.plan(out_m, out_n, red, LAYOUT[kind], t, None if rule else v, splits, rule)
        except ValueError as e:  # e.g. more splits than k slices: record it, keep going
            say(f"  {name:<30} {label(*cand):<30} FAILED: {e}")
            rows.append({**row0, "config": label(*cand), "error": str(e)})
            continue
        v, t, splits = launch.variant, launch.tiles, launch.splits
        lab = (f"{rule} = " if rule else "") + label(v, t, splits)
        ran = G.loaded_variant(v, p.da, p.db, p.dout)
        if ran != v:
            lab += f" (ran v{ran}: arrays not 16-byte aligned)"
        try:
            p.out.fill_(float("nan"))
            p.ours(v, t, splits)
            cuda.synchronize()
            err = rel_err(p.out, p.want)
            got = timed(lambda: p.ours(v, t, splits), timing, "numba") if time_it else {}
        except Exception as e:  # noqa: BLE001 - keep the sweep going, record the failure
            say(f"  {name:<30} {lab:<30} FAILED: {type(e).__name__}: {e}")
            rows.append({**row0, "config": lab, "variant": v, "tiles": t.__dict__,
                         "error": f"{type(e).__name__}: {e}"})
            continue
        r = {**row0, "config": lab, "variant": v, "ran_variant": ran, "tiles": t.__dict__, "splits": splits or 1,
             "rel_err_vs_cublas": err, "blocks": -(-out_m // t.bm) * -(-out_n // t.bn) * (splits or 1)}
        ok = "" if err <= 1e-5 else "  <-- ERROR > 1e-5"
        if time_it:
            best = got["ms"]
            r.update(got, tflops=p.flops / best / 1e9, cublas_tflops=p.flops / c_best / 1e9,
                     pct_of_cublas=100 * c_best / best, **{"cublas_" + key: x for key, x in cub.items()})
            also = ""
            if "host_ms" in got:
                also += f"  host {got['host_ms'] * 1e3:5.1f} us/launch"
            if "plain_ms" in got:
                r["plain_pct_of_cublas"] = 100 * cub["plain_ms"] / got["plain_ms"]
                also += f"  plain {r['plain_pct_of_cublas']:5.1f}%"
            say(f"  {name:<30} {lab:<30} {r['tflops']:6.2f} TFLOP/s  {best:8.4f} ms"
                f"  {r['pct_of_cublas']:5.1f}% of cuBLAS  err {err:.1e}  {r['blocks']} blocks{also}{ok}")
        else:
            say(f"  {name:<30} {lab:<30} err {err:.1e}{ok}")
        rows.append(r)
    return rows


def out_dims(kind: str, dims) -> tuple[int, int, int]:
    """(rows, columns, reduction length) of the GEMM that ``kind`` runs for x (M, K), w (N, K)."""
    m, n, k = dims
    return {"fwd": (m, n, k), "dx": (m, k, n), "dw": (n, k, m)}[kind]


def candidates_for(kind: str, dims, splits: list[int] | None = None, variants: list[int] | None = None) -> list:
    """The candidates timed at one shape; ``splits``: the proposed rule and variants 11 and 13
    (11 with staged 16-byte stores) on its tiles at each of these k split counts instead (wave
    quantization: ``--splits``); ``variants``: the proposed rule and these variants on its tiles,
    at the launcher's split count."""
    out_m, out_n, red = out_dims(kind, dims)
    if variants:
        return [("proposed", None)] + [(v, G.PROPOSED_TILES) for v in variants]
    if splits:
        return [("proposed", None)] + [(v, G.PROPOSED_TILES, s) for v in (11, 13) for s in splits]
    proposed = G.rule_launch(out_m, out_n, red, rule="proposed")
    skinny = G.rule_launch(out_m, out_n, red, rule="skinny")
    if skinny != proposed:
        # a 16-wide output (LoRA): the rules and the skinny tiles with half the splits; the
        # 128 x 128 candidates would be 7/8 padding
        return [("proposed", None), ("skinny", None), (skinny.variant, skinny.tiles, max(1, skinny.splits // 2)),
                (11, skinny.tiles, skinny.splits)]  # the skinny tiles with 16-byte loads
    if proposed.tiles == G.PROPOSED_TILES and proposed.splits > 1:
        return CANDIDATES + [(G.PROPOSED_VARIANT, G.PROPOSED_TILES, 1)]  # the unsplit launch beside the rule's
    return CANDIDATES


def summary(rows: list[dict]) -> list[dict]:
    """Per shape: cuBLAS, the proposed rule's choice and the best candidate."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == shape and "ms" in r]
        if not timed:
            out.append({"shape": shape, "skipped": True})
            continue
        best = min(timed, key=lambda r: r["ms"])
        prop = next((r for r in timed if r["config"].startswith("proposed")), None)
        out.append({"shape": shape, "cublas_tflops": best["cublas_tflops"],
                    "proposed": prop and {"config": prop["config"], "pct_of_cublas": prop["pct_of_cublas"]},
                    "best": {"config": best["config"], "tflops": best["tflops"],
                             "pct_of_cublas": best["pct_of_cublas"]}})
    return out


def pct_table(rows: list[dict], key: str = "pct_of_cublas") -> list[str]:
    """One line per candidate (the rules by name, whatever they ran), one column per timed shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "ms" in r))
    cands = list(dict.fromkeys(r["config"].split(" = ")[0] for r in rows if "ms" in r))
    pct = {(r["shape"], r["config"].split(" = ")[0]): r[key] for r in rows if "ms" in r}
    lines = [f"{'':<34}" + "".join(f"{i + 1:>6}" for i in range(len(shapes)))]
    for c in cands:
        cells = "".join(f"{pct[(s, c)]:6.1f}" if (s, c) in pct else f"{'-':>6}" for s in shapes)
        lines.append(f"{c:<34}{cells}")
    lines += [f"{i + 1:>3}: {s}" for i, s in enumerate(shapes)]
    return lines


# --dtype bf16: (label, tiles or None for the rule's, output dtype)
# (run 1 also timed 8 warps of 64 x 32 at 128x128x32/s3: 30-37% of cuBLAS, and the rule's tiles
# with 2 stages: 30-43%, against the rule's 35-51%; results/gemm-bf16-h200/run1/)
BF16_TILES = [GB.MmaTiles(bm=128, bn=128, wm=64, wn=64, stages=4, bk=32),  # 64 KiB, dynamic
              GB.MmaTiles(bm=128, bn=128, wm=64, wn=64, stages=3, bk=64),  # 96 KiB
              GB.MmaTiles(bm=128, bn=128, wm=64, wn=64, stages=2, bk=64),  # 64 KiB
              GB.MmaTiles(bm=128, bn=256, wm=64, wn=64, stages=3, bk=32)]  # 8 warps, 72 KiB
# --wgmma: the warpgroup-MMA kernel's tile shapes (gemm_wgmma), timed beside the rule instead
WGMMA_TILES = [GW.WgmmaTiles(128, 128, 4), GW.WgmmaTiles(128, 256, 4), GW.WgmmaTiles(128, 128, 3, blocks=2),
               GW.WgmmaTiles(128, 128, 4, ahead=1), GW.WgmmaTiles(128, 256, 4, ahead=1),
               GW.WgmmaTiles(128, 128, 5, ahead=1)]


class ProblemBf16:
    """bf16 operands of one shape and kind, cuBLAS bf16, and a float64 reference."""

    def __init__(self, kind: str, m: int, n: int, k: int):
        g = torch.Generator("cuda").manual_seed(0)
        self.kind, self.flops = kind, 2.0 * m * n * k
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        if kind == "fwd":
            ops, shape, self.fn = (x, w), (m, n), GB.gemm_bf16
            self.cublas = lambda: torch.matmul(x, w.T, out=self.out_bf)
            ref = lambda: x.double() @ w.double().T  # noqa: E731
        elif kind == "dx":
            ops, shape, self.fn = (dy, w), (m, k), GB.linear_dx_bf16
            self.cublas = lambda: torch.matmul(dy, w, out=self.out_bf)
            ref = lambda: dy.double() @ w.double()  # noqa: E731
        else:
            ops, shape, self.fn = (dy, x), (n, k), GB.linear_dw_bf16
            self.cublas = lambda: torch.matmul(dy.T, x, out=self.out_bf)
            ref = lambda: dy.double().T @ x.double()  # noqa: E731
        self.out_bf = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        self.out_f = torch.empty(shape, device="cuda")
        self.want = ref()
        self.dims = out_dims(kind, (m, n, k))
        self.da, self.db = (cuda.as_cuda_array(t.view(torch.int16)) for t in ops)
        self.d_bf, self.d_f = cuda.as_cuda_array(self.out_bf.view(torch.int16)), cuda.as_cuda_array(self.out_f)

    def ours(self, tiles, out: str):
        self.fn(self.da, self.db, self.d_bf if out == "bf16" else self.d_f, tiles=tiles)

    def err(self, out: str) -> float:
        got = (self.out_bf if out == "bf16" else self.out_f).double()
        return float((got - self.want).abs().max() / self.want.abs().max())


def bf16_candidates(tiles: bool = True):
    """The rule with both outputs, or (``tiles``) with a bf16 output beside the other tile shapes
    (run 1: the two outputs within 1 point of each other at all 15 shapes)."""
    rule = [("rule bf16-out", None, "bf16"), ("rule fp32-out", None, "fp32")]
    return rule[:1] + [(f"{t.label()} bf16-out", t, "bf16") for t in BF16_TILES] if tiles else rule


def run_shape_bf16(name, kind, dims, time_it: bool, deadline: float, tiles: bool = True) -> list[dict]:
    m, n, k = dims
    row0 = {"shape": name, "kind": kind, "M": m, "N": n, "K": k}
    cands = bf16_candidates(tiles and time_it)  # ragged: the rule's builds alone
    if time_it and time.time() > deadline:
        return [{**row0, "config": c[0], "skipped": "time budget"} for c in cands]
    p = ProblemBf16(kind, m, n, k)
    p.cublas()
    torch.cuda.synchronize()
    cub_err = float((p.out_bf.double() - p.want).abs().max() / p.want.abs().max())
    if time_it:
        cub = timed(p.cublas, "held", "torch")
        say(f"  {name:<30} {'cuBLAS bf16':<34} {p.flops / cub['ms'] / 1e9:7.1f} TFLOP/s  {cub['ms']:8.4f} ms"
            f"  err {cub_err:.1e}")
    rows = []
    for lab, tiles, out in cands:
        if time_it and time.time() > deadline:
            rows.append({**row0, "config": lab, "skipped": "time budget"})
            continue
        launch = GB.choose(*p.dims, out_bf16=out == "bf16")
        t = tiles or launch.tiles
        full = f"{lab} = {t.label()}" + (f" split{launch.splits}" if tiles is None and launch.splits > 1 else "")
        try:
            (p.out_bf if out == "bf16" else p.out_f).fill_(float("nan"))
            p.ours(tiles, out)
            cuda.synchronize()
            err = p.err(out)
            got = timed(lambda: p.ours(tiles, out), "held", "numba") if time_it else {}
        except Exception as e:  # noqa: BLE001 - keep the sweep going, record the failure
            say(f"  {name:<30} {full:<34} FAILED: {type(e).__name__}: {e}")
            rows.append({**row0, "config": lab, "error": f"{type(e).__name__}: {e}"})
            continue
        tol = 1e-2 if out == "bf16" else 1e-4
        ok = "" if err <= max(tol, 2 * cub_err) else f"  <-- ERROR > {tol:g}"
        r = {**row0, "config": lab, "ran": full, "out": out, "rel_err_vs_fp64": err, "cublas_rel_err": cub_err}
        if time_it:
            r.update(got, tflops=p.flops / got["ms"] / 1e9, cublas_tflops=p.flops / cub["ms"] / 1e9,
                     pct_of_cublas=100 * cub["ms"] / got["ms"], **{"cublas_" + key: x for key, x in cub.items()})
            say(f"  {name:<30} {full:<34} {r['tflops']:7.1f} TFLOP/s  {got['ms']:8.4f} ms  "
                f"{r['pct_of_cublas']:5.1f}% of cuBLAS  err {err:.1e}  host {got['host_ms'] * 1e3:5.1f} us{ok}")
        else:
            say(f"  {name:<30} {full:<34} err {err:.1e} (cuBLAS {cub_err:.1e}){ok}")
        rows.append(r)
    return rows


def tensor_main(args, shapes, kinds, t0, deadline, dtype: str, run, versus: str, tables) -> None:
    """``--dtype bf16`` / ``tf32``: ragged shapes per layout, then the timed shapes by ``run``
    (``run_shape_bf16`` or ``run_shape_tf32``), one % table per (row key, baseline name) of
    ``tables``, and ``gemm_{dtype}_sweep.json``."""
    res = {"env": run_env(reps=REPS, samples=SAMPLES, statistic="best of samples", set=args.set,
                          timing="held", dtype=dtype, sm_count=GB.sm_count())}
    say(f"== {dtype}: ragged shapes per layout (correctness against float64, and the builds)")
    res["ragged"] = []
    for kind in ([] if args.skip_ragged else kinds):
        t1 = time.time()
        for dims in (RAGGED, RAGGED_ALIGNED, (1000, 520, 1032)):
            res["ragged"] += run(f"ragged {kind} {'x'.join(map(str, dims))}", kind, dims, False, deadline)
        say(f"  ({time.time() - t1:.0f} s)")
    say(f"== GEMM {dtype} vs {versus}; {REPS} launches held behind a spin, best of {SAMPLES}")
    res["gemm"] = []
    for name, kind, dims in shapes:
        res["gemm"] += run(name, kind, dims, True, deadline, not args.rule_only)
        say(f"  ({time.time() - t0:.0f} s)")
    for key, what in tables:
        say(f"== % of {what}, candidate x shape (columns: the shapes above, in order)")
        for line in pct_table(res["gemm"], key):
            say("  " + line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemm_{dtype}_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    say(f"wrote {out / f'gemm_{dtype}_sweep.json'} ({time.time() - t0:.0f} s)")


# --dtype tf32: (label, precision, tiles or None for the rule's); the rule: tf32 128x128x16/w64x64,
# 3xtf32 the same block with w64x32 (64 x 64 spills offline: Note [tf32 GEMM tile])
TF32_TILES = [("3xtf32 w64x64 (spills)", "3xtf32", GT.Tf32Tiles()),
              ("tf32 w64x32", "tf32", GT.GPU_TILES_3X),
              ("tf32 bk32 s3 (96 KiB)", "tf32", GT.Tf32Tiles(bk=32)),
              ("tf32 s4 (64 KiB)", "tf32", GT.Tf32Tiles(stages=4))]


class ProblemTf32:
    """float32 operands of one shape and kind, cuBLAS TF32 and fp32, and a float64 reference."""

    def __init__(self, kind: str, m: int, n: int, k: int):
        g = torch.Generator("cuda").manual_seed(0)
        self.kind, self.flops = kind, 2.0 * m * n * k
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g)
        dy = torch.randn(m, n, device="cuda", generator=g)
        a, b, self.fn = {"fwd": (x, w.T, GT.gemm_tf32), "dx": (dy, w, GT.linear_dx_tf32),
                         "dw": (dy.T, x, GT.linear_dw_tf32)}[kind]
        ops = {"fwd": (x, w), "dx": (dy, w), "dw": (dy, x)}[kind]
        self.out = torch.empty(a.shape[0], b.shape[1], device="cuda")
        self.out_cublas = torch.empty_like(self.out)
        self.cublas = lambda: torch.matmul(a, b, out=self.out_cublas)
        self.want = a.double() @ b.double()
        self.dims = out_dims(kind, (m, n, k))
        self.da, self.db = (cuda.as_cuda_array(t) for t in ops)
        self.dout = cuda.as_cuda_array(self.out)

    def ours(self, precision, tiles):
        self.fn(self.da, self.db, self.dout, precision=precision, tiles=tiles)

    def err(self, got) -> float:
        return float((got.double() - self.want).abs().max() / self.want.abs().max())

    def time_cublas(self, tf32: bool) -> tuple[dict, float]:
        """(held timing, error) of cuBLAS with TF32 on or off (restored to off)."""
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            self.cublas()
            torch.cuda.synchronize()
            e = self.err(self.out_cublas)
            return timed(self.cublas, "held", "torch"), e
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False


def run_shape_tf32(name, kind, dims, time_it: bool, deadline: float, tiles: bool = True) -> list[dict]:
    m, n, k = dims
    row0 = {"shape": name, "kind": kind, "M": m, "N": n, "K": k}
    cands = [("rule tf32", "tf32", None), ("rule 3xtf32", "3xtf32", None)] + (TF32_TILES if tiles and time_it else [])
    if time_it and time.time() > deadline:
        return [{**row0, "config": c[0], "skipped": "time budget"} for c in cands]
    p = ProblemTf32(kind, m, n, k)
    base = {}
    for label_, tf32 in (("cuBLAS TF32", True), ("cuBLAS fp32", False)):
        if time_it:
            got, e = p.time_cublas(tf32)
            base[tf32] = (got["ms"], e)
            say(f"  {name:<30} {label_:<34} {p.flops / got['ms'] / 1e9:7.1f} TFLOP/s  {got['ms']:8.4f} ms  err {e:.1e}")
    rows = []
    for lab, precision, t in cands:
        if time_it and time.time() > deadline:
            rows.append({**row0, "config": lab, "skipped": "time budget"})
            continue
        launch = GT.choose_tf32(*p.dims, precision=precision)
        ran = (t or launch.tiles).label() + (f" split{launch.splits}" if t is None and launch.splits > 1 else "")
        full = f"{lab} = {ran}"
        try:
            p.out.fill_(float("nan"))
            p.ours(precision, t)
            cuda.synchronize()
            err = p.err(p.out)
            got = timed(lambda: p.ours(precision, t), "held", "numba") if time_it else {}
        except Exception as e:  # noqa: BLE001 - keep the sweep going, record the failure
            say(f"  {name:<30} {full:<34} FAILED: {type(e).__name__}: {e}")
            rows.append({**row0, "config": lab, "error": f"{type(e).__name__}: {e}"})
            continue
        tol = 2e-3 if precision == "tf32" else 1e-5
        ok = "" if err <= tol else f"  <-- ERROR > {tol:g}"
        r = {**row0, "config": lab, "ran": full, "precision": precision, "rel_err_vs_fp64": err}
        if time_it:
            (tf32_ms, tf32_err), (fp32_ms, fp32_err) = base[True], base[False]
            r.update(got, tflops=p.flops / got["ms"] / 1e9, cublas_tf32_ms=tf32_ms, cublas_fp32_ms=fp32_ms,
                     cublas_tf32_rel_err=tf32_err, cublas_fp32_rel_err=fp32_err,
                     pct_of_cublas_tf32=100 * tf32_ms / got["ms"], pct_of_cublas_fp32=100 * fp32_ms / got["ms"])
            say(f"  {name:<30} {full:<34} {r['tflops']:7.1f} TFLOP/s  {got['ms']:8.4f} ms  "
                f"{r['pct_of_cublas_tf32']:5.1f}% of TF32 {r['pct_of_cublas_fp32']:6.1f}% of fp32  err {err:.1e}  "
                f"host {got['host_ms'] * 1e3:5.1f} us{ok}")
        else:
            say(f"  {name:<30} {full:<34} err {err:.1e}{ok}")
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-ragged", action="store_true", help="bf16, tf32: no ragged correctness shapes (their builds)")
    ap.add_argument("--rule-only", action="store_true", help="bf16, tf32: time the rule's launches only, not "
                    "BF16_TILES / TF32_TILES")
    ap.add_argument("--wgmma", action="store_true", help="bf16: time the wgmma kernel's WGMMA_TILES beside the rule "
                    "instead of BF16_TILES")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "tf32"), default="fp32",
                    help="fp32: the CUDA-core GEMM against cuBLAS fp32; bf16: the tensor-core GEMM against cuBLAS bf16; "
                    "tf32: the tf32 / 3xtf32 tensor-core GEMM against cuBLAS TF32 and fp32")
    ap.add_argument("--out", default=".")
    ap.add_argument("--set", choices=sorted(SETS), default="7b", help="which model's shapes")
    ap.add_argument("--quick", action="store_true", help="forward shapes only (--kinds fwd)")
    ap.add_argument("--kinds", nargs="+", choices=sorted(LAYOUT), help="only these GEMMs (fwd: y = x w^T, "
                    "dx: dy w, dw: dy^T x), e.g. --kinds dx dw for the backward layouts in a call of their own")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new timings after this")
    ap.add_argument("--splits", type=int, nargs="+", help="time the proposed rule and variants 11 and 13 on its tiles "
                    "split k this many ways (e.g. 1 2 3 4), at every shape, instead of the candidates")
    ap.add_argument("--shapes", nargs="+", metavar="TEXT", help="only the shapes whose name contains one of "
                    "these, e.g. --kinds dx --shapes 'k/v GQA8'")
    ap.add_argument("--variants", type=int, nargs="+", choices=sorted(G.VARIANTS),
                    help="time the proposed rule and these variants on its tiles instead of the candidates")
    ap.add_argument("--timing", choices=("held", "plain", "both"), default="held",
                    help="held: the GPU's time alone (launches queued behind a spin); plain: events right "
                    "around the launches, the first one's host cost included (sweeps 1-7); both")
    args = ap.parse_args()
    tf32_off()
    t0 = time.time()
    deadline = t0 + args.budget_s
    import numba

    dev = torch.cuda.get_device_name()
    res = {"env": run_env(reps=REPS, samples=SAMPLES, statistic="best of samples", set=args.set,
                          timing=args.timing)}
    say(f"== {dev}, torch {torch.__version__}, numba {numba.__version__}, "
        f"TF32 {torch.backends.cuda.matmul.allow_tf32}, shapes {args.set}")
    kinds = ["fwd"] if args.quick else args.kinds or list(LAYOUT)
    shapes = [s for s in SETS[args.set] if s[1] in kinds and (not args.shapes or any(t in s[0] for t in args.shapes))]
    if not shapes:
        raise SystemExit(f"gemm_sweep: no shape of set {args.set!r} matches kinds {kinds} and --shapes {args.shapes}")
    kinds = list(dict.fromkeys(kind for _, kind, _ in shapes))
    if args.dtype == "bf16":
        if args.wgmma:
            BF16_TILES[:] = WGMMA_TILES
        tensor_main(args, shapes, kinds, t0, deadline, "bf16", run_shape_bf16, "cuBLAS bf16",
                    [("pct_of_cublas", "cuBLAS bf16")])
        return
    if args.dtype == "tf32":
        tensor_main(args, shapes, kinds, t0, deadline, "tf32", run_shape_tf32, "cuBLAS TF32 and fp32",
                    [("pct_of_cublas_tf32", "cuBLAS TF32"), ("pct_of_cublas_fp32", "cuBLAS fp32 (TF32 off)")])
        return

    say("== ragged shape per layout (correctness, and the builds): registers / local memory per thread")
    res["ragged"], res["kernels"] = [], {}
    for kind in kinds:
        t1 = time.time()
        if args.splits or args.variants:
            cands = candidates_for(kind, RAGGED, args.splits, args.variants)
        else:
            cands = CANDIDATES + [(G.PROPOSED_VARIANT, G.PROPOSED_TILES, 2)]
        for dims in (RAGGED, RAGGED_ALIGNED):
            res["ragged"] += run_shape(f"ragged {kind} {'x'.join(map(str, dims))}", kind, dims, cands,
                                       False, deadline)
        if args.set == "lora":
            dims = RAGGED_SKINNY[kind]
            res["ragged"] += run_shape(f"ragged {kind} {'x'.join(map(str, dims))}", kind, dims,
                                       candidates_for(kind, dims)[1:], False, deadline)
        for v, t in dict.fromkeys((c[0], c[1]) for c in cands if c[1] is not None):
            info = kernel_resources(v, t, LAYOUT[kind])
            res["kernels"][f"{label(v, t)} {LAYOUT[kind]}"] = info
            say(f"  {label(v, t):<30} {LAYOUT[kind]}: regs {info['regs']}, local {info['local_bytes']} B")
        say(f"  ({time.time() - t1:.0f} s)")

    say(f"== GEMM fp32 vs cuBLAS (TF32 off); events around {REPS} launches ({args.timing}), best of {SAMPLES}")
    res["gemm"] = []
    for name, kind, dims in shapes:
        res["gemm"] += run_shape(name, kind, dims, candidates_for(kind, dims, args.splits, args.variants), True,
                                 deadline, args.timing)
        say(f"  ({time.time() - t0:.0f} s)")

    res["summary"] = summary(res["gemm"])
    say("== per shape: cuBLAS, the proposed rule's choice, the best candidate (% of cuBLAS fp32)")
    for s in res["summary"]:
        if s.get("skipped"):
            say(f"  {s['shape']:<30} skipped (time budget)")
            continue
        p = s["proposed"]
        say(f"  {s['shape']:<30} cuBLAS {s['cublas_tflops']:6.2f} TFLOP/s  proposed "
            f"{p['pct_of_cublas'] if p else float('nan'):5.1f}%  best {s['best']['pct_of_cublas']:5.1f}% "
            f"({s['best']['config']})")
    say("== % of cuBLAS fp32, candidate x shape (columns: the shapes above, in order)")
    for line in pct_table(res["gemm"]):
        say("  " + line)
    skipped = sorted({r["shape"] for r in res["gemm"] if r.get("skipped")})
    if skipped:
        say(f"== skipped for time (some or all candidates): {', '.join(skipped)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    say(f"wrote {out / 'gemm_sweep.json'} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
