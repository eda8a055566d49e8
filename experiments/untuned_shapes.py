"""Scheduling at shapes nobody tuned (issue 32, item 7): the three shapes of
``results/untuned-shapes/RULE.md``, derived here from its table, then measured.

    python experiments/untuned_shapes.py --out experiments/results/untuned-shapes          # sim (CPU)
    python experiments/untuned_shapes.py --gemm-launch-us 25 --launch-us 15 --out OUT      # sim, what-if host costs
    python experiments/untuned_shapes.py --backend cuda --budgets 0.5 --out OUT            # the H200

Sim: each shape's LoRA step at each budget, event-driven (as it runs now, and "before": without
device waits, copy window or compute in compile order, on the graph compiled without prefetch:
what ran at fe59af7) and fixed-order, on the sim backend
with the H200's host costs (``CostModel.h200``) and with the default costs, mean of 3 seeds,
jitter 5%; ``ratio``: step / the lower bound (the larger of max(compute, copies) and the
precedence bound, ``vmstoolkit.exec.bounds``), ``resource_ratio``: step / max(compute, copies). The issue's own shape comes first, as the
tuning case. Cuda (where "before" runs the old executor on the
prefetching graph): every shape in one process (the kernels are compiled once), the three
executors interleaved step by step, best of ``--steps`` after a warm-up step; gradients are
not checked here (``experiment train-offload`` checks them).
Writes ``<out>/untuned_<backend>.jsonl`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vmstoolkit.exec.graph import LlamaConfig

# RULE.md's table: (model, hidden, heads, kv heads, FFN), in its order
CANDIDATES = [("Mistral-7B-v0.1", 4096, 32, 8, 14336), ("Qwen2-7B", 3584, 28, 4, 18944),
              ("Yi-34B", 7168, 56, 8, 20480), ("Meta-Llama-3-70B", 8192, 64, 8, 28672)]
TUNED = {(4096, 32, 32, 11008), (4096, 32, 8, 11008), (5120, 40, 8, 13824)}
ISSUE = ("issue 32 (tuning case)", 5120, 40, 8, 13824, 12)
SEQ, RANK = 1536, 16
EXPECTED = {"Mistral-7B-v0.1": 15, "Qwen2-7B": 14, "Yi-34B": 5}  # RULE.md's bold figures
# "before": the executor without device waits, copy window and compute in compile order (what ran
# on the H200 at fe59af7); in the sim also on the graph compiled without prefetch
RUNS = {"event-driven": ("event-driven", {}), "fixed-order": ("fixed-order", {}),
        "event-driven (before)": ("event-driven", {"device_waits": False, "copy_window": 0, "compute_in_order": False})}


def block_bytes(h, nh, kv, f) -> int:
    return LlamaConfig(n_blocks=1, hidden=h, heads=nh, kv_heads=kv, ffn=f).block_weight_bytes()


def shapes() -> list[tuple]:
    """(name, hidden, heads, kv, ffn, blocks) by the rule; fails if it disagrees with RULE.md."""
    cap = ISSUE[5] * block_bytes(*ISSUE[1:5])
    out = []
    for name, h, nh, kv, f in CANDIDATES:
        if (h, nh, kv, f) in TUNED:
            continue
        out.append((name, h, nh, kv, f, cap // block_bytes(h, nh, kv, f)))
        if len(out) == 3:
            break
    got = {s[0]: s[5] for s in out}
    if got != EXPECTED:
        sys.exit(f"the rule gives {got}, RULE.md says {EXPECTED}")
    return out


def config(s) -> LlamaConfig:
    _, h, nh, kv, f, n = s
    return LlamaConfig(n_blocks=int(n), seq=SEQ, hidden=h, heads=nh, kv_heads=kv, ffn=f)


def h200_costs(gemm_launch_us: float | None = None, launch_us: float | None = None):
    """``CostModel.h200()``, or with its host launch costs replaced (a what-if: a GEMM launch
    ``gemm_launch_us``, every other vertex ``launch_us``, copies at most that)."""
    from vmstoolkit.exec.backends.sim import CostModel

    if gemm_launch_us is None and launch_us is None:
        return CostModel.h200()
    base = CostModel.h200()
    gemm = (gemm_launch_us if gemm_launch_us is not None else 150.0) * 1e-6
    other = launch_us * 1e-6 if launch_us is not None else base.launch_s
    copy = min(30e-6, other)
    return CostModel.h200(launch_s=other, launch_s_by_op=(("linear", gemm), ("linear_dx", gemm), ("linear_dw", gemm),
                                                          ("reload", copy), ("offload", copy), ("move", copy)))


def sim_rows(s, budgets, h200=None) -> list[dict]:
    from vmstoolkit.exec.backends.sim import CostModel, SimBackend
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.executor import execute
    from vmstoolkit.exec.train_graph import build_train_step

    g = build_train_step(config(s), "lora", rank=RANK).graph
    ws = working_set(g)
    rows = []
    for frac in budgets:
        t0 = time.perf_counter()
        mg = compile_memory_graph(g, int(ws * frac))
        compile_s = time.perf_counter() - t0
        old = compile_memory_graph(g, int(ws * frac), prefetch=False)
        for costs, cost in (("h200", h200 or CostModel.h200()), ("default", CostModel())):
            for label, (ex, kw) in RUNS.items():
                mg_ = old if label == "event-driven (before)" else mg
                lb = cost.lower_bound(mg_)
                spans = [execute(mg_, SimBackend(cost, seed=i, jitter=0.05), ex, **kw).makespan_s for i in range(3)]
                rows.append({"shape": s[0], "blocks": int(s[5]), "budget_fraction": frac, "budget": int(ws * frac),
                             "costs": costs, "executor": label, "step_s": float(np.mean(spans)),
                             "lower_bound_s": lb["lower_bound_s"], "resource_s": lb["resource_s"],
                             "precedence_s": lb["precedence_s"], "compute_s": lb["compute_s"], "h2d_s": lb["h2d_s"],
                             "ratio": float(np.mean(spans)) / lb["lower_bound_s"],
                             "resource_ratio": float(np.mean(spans)) / lb["resource_s"], "vertices": len(mg_.vertices),
                             "reloaded_bytes": mg_.reloaded_bytes, "compile_s": compile_s})
                print(f"{s[0]:24s} {frac:5} {costs:7s} {label:22s} {rows[-1]['ratio']:.3f} "
                      f"(resource {rows[-1]['resource_ratio']:.3f})", flush=True)
    return rows


def cuda_rows(s, budgets, steps) -> list[dict]:
    """Each budget: a warm-up step, then ``steps`` measured steps per executor, interleaved
    (event-driven, event-driven before, fixed-order, again ...); best and all step times, the
    bound (``measure_lower_bound``: direct compute, copies at the measured rate, the precedence
    bound over each vertex's CUDA-event time), and where the host's time went (``host`` keys;
    ``lower_bound.warmup_s`` is the direct run's first pass, the JIT of the process's kernels)."""
    from vmstoolkit.exec.backends.cuda import CudaBackend, measure_lower_bound
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.executor import execute
    from vmstoolkit.exec.train_graph import build_train_step, random_train_values

    host: dict[str, float] = {}

    def timed(name, fn, *args, **kw):
        t = time.perf_counter()
        out = fn(*args, **kw)
        host[name] = host.get(name, 0.0) + time.perf_counter() - t
        return out

    tg = timed("build", build_train_step, config(s), "lora", rank=RANK)
    ws = timed("working_set", working_set, tg.graph)
    values = timed("random_values", random_train_values, tg, 0)
    pool = PinnedPool()
    runs = RUNS
    rows = []
    try:
        for frac in budgets:
            mg = timed("compile", compile_memory_graph, tg.graph, int(ws * frac))
            lb = timed("lower_bound", measure_lower_bound, mg, values)
            for k, sec in lb.pop("direct_s").items():  # where the bound's direct run went (warmup_s: the JIT)
                host[f"lower_bound.{k}"] = host.get(f"lower_bound.{k}", 0.0) + sec
            spans: dict[str, list[float]] = {k: [] for k in runs}
            for rep in range(steps + 1):  # rep 0: warm-up (JIT, pinning), not counted
                for label, (ex, kw) in runs.items():
                    be = timed("backend", CudaBackend, values, pin="register", pool=pool)
                    try:
                        r = timed("execute", execute, mg, be, ex, **kw)
                    finally:
                        timed("close", be.close)
                    if rep:
                        spans[label].append(r.makespan_s)
            for label in runs:
                best = min(spans[label])
                rows.append({"shape": s[0], "blocks": int(s[5]), "budget_fraction": frac, "budget": int(ws * frac),
                             "executor": label, "step_s": best, "steps_s": spans[label], **lb,
                             "ratio": best / lb["lower_bound_s"], "resource_ratio": best / lb["resource_s"],
                             "vertices": len(mg.vertices), "reloaded_bytes": mg.reloaded_bytes,
                             "host_s": dict(host)})
                print(f"{s[0]:24s} {frac:5} {label:22s} {best:.4f} s, bound {lb['lower_bound_s']:.4f} s "
                      f"({rows[-1]['ratio']:.3f}x; resource {lb['resource_s']:.4f} s, {rows[-1]['resource_ratio']:.3f}x)",
                      flush=True)
            print(f"{s[0]:24s} host seconds so far: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()), flush=True)
    finally:
        pool.close()
    return rows


def table(rows) -> str:
    lines = ["| shape | blocks | budget | costs | executor | step s | bound s | ratio | / max(compute, copies) |",
             "|---" * 9 + "|"]
    for r in rows:
        frac = r.get("budget_fraction", r["budget"])
        res = f"{r['resource_ratio']:.3f}" if "resource_ratio" in r else ""
        lines.append(f"| {r['shape']} | {r['blocks']} | {frac} | {r.get('costs', 'H200')} | {r['executor']} | "
                     f"{r['step_s']:.4f} | {r['lower_bound_s']:.4f} | {r['ratio']:.3f} | {res} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--skip-issue", action="store_true", help="leave out the issue's own (tuning) shape")
    ap.add_argument("--gemm-launch-us", type=float, help="sim, what-if: a GEMM launch's host time in the 'h200' "
                    "costs (CostModel.h200 says 150)")
    ap.add_argument("--launch-us", type=float, help="sim, what-if: every other launch's host time there (40; "
                    "copies take at most this, 30)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    todo = ([] if a.skip_issue else [ISSUE]) + shapes()
    h200 = h200_costs(a.gemm_launch_us, a.launch_us)
    rows = []
    for s in todo:
        rows += sim_rows(s, a.budgets, h200) if a.backend == "sim" else cuda_rows(s, a.budgets, a.steps)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / f"untuned_{a.backend}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"command": " ".join(sys.argv), **r}) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
