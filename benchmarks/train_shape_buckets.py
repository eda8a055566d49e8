"""Shapes that change per step: bucket ratio against planning share and padding cost.

    python benchmarks/train_shape_buckets.py [--blocks 4] [--steps 100] [--variant lora]

100 training steps of LLaMA-7B-wide blocks with a length drawn uniformly in 256..4096 every
step, under one budget (half the working set at 4096), on the sim backend. For each bucket
ratio (1.0: every multiple of 256, i.e. recompiling on almost every new length; larger: fewer,
coarser buckets): plans compiled, planning seconds (host), simulated seconds of the steps,
planning share of (planning + simulated), and the padding cost: simulated seconds against the
same steps run at their exact lengths (each compiled once, planning not counted).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from vmstoolkit.exec.compiler import working_set
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.plan_cache import PlanCache
from vmstoolkit.exec.train_experiment import _Sim, run_steps, step_lengths
from vmstoolkit.exec.train_graph import build_train_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variant", default="lora")
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0, 1.125, 1.25, 1.5, 2.0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = LlamaConfig(n_blocks=args.blocks)
    seqs = step_lengths(None, (256, 4096), args.steps, seed=0)
    budget = working_set(build_train_step(LlamaConfig(n_blocks=args.blocks, seq=4096), args.variant).graph) // 2
    sim = _Sim(seed=0, jitter=0.0, check=False)
    exact = PlanCache(cfg, args.variant, budget, granule=1, ratio=1.0, max_seq=4096)  # one plan per length
    exact_s = sum(r.step_s for r in run_steps(exact, seqs, sim, "event-driven"))
    rows = []
    for ratio in args.ratios:
        cache = PlanCache(cfg, args.variant, budget, ratio=ratio, max_seq=4096)
        recs = run_steps(cache, seqs, sim, "event-driven")
        sim_s = sum(r.step_s for r in recs)
        rows.append({"ratio": ratio, "plans": cache.misses, "planning_s": cache.plan_s, "simulated_s": sim_s,
                     "planning_share": cache.plan_s / (cache.plan_s + sim_s),
                     "padding_cost": sim_s / exact_s - 1.0,
                     "wall_vs_exact_unplanned": (sim_s + cache.plan_s) / exact_s})
    rows.append({"ratio": "exact", "plans": exact.misses, "planning_s": exact.plan_s, "simulated_s": exact_s,
                 "planning_share": exact.plan_s / (exact.plan_s + exact_s), "padding_cost": 0.0,
                 "wall_vs_exact_unplanned": (exact_s + exact.plan_s) / exact_s})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    t = Table(title=f"{args.steps} steps, 256..4096, {args.blocks} blocks, {args.variant}, budget {budget / 2**30:.2f} GiB")
    for c in ("bucket ratio", "plans", "planning s", "simulated s", "planning share", "padding cost",
              "(sim + plan) / exact sim"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["ratio"]), str(r["plans"]), f"{r['planning_s']:.2f}", f"{r['simulated_s']:.2f}",
                  f"{r['planning_share']:.2%}", f"{r['padding_cost']:+.1%}", f"{r['wall_vs_exact_unplanned']:.3f}")
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
