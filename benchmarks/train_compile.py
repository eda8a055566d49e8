"""Compile time of training graphs against the number of blocks (issue 17: near-linear).

    python benchmarks/train_compile.py [--blocks 1 2 4 8 16 32 64] [--fraction 0.5] [--json]

For LoRA and full fine-tuning of LLaMA-7B-wide blocks at 1 x 2048: vertices of the task graph and
of the memory graph, seconds to build the task graph, to compile the memory graph at
``fraction`` of the working set of 16 blocks scaled to the block count (the working set itself
is not searched here: that costs several compiles), and to run the race checker; the last column
is compile seconds per 1000 memory-graph vertices, flat when compile time is linear. Best of 3.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.train_graph import build_train_step


def best(fn, repeat=3):
    out, t = None, float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return out, t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for variant in ("lora", "full"):
        per_block_ws = working_set(build_train_step(LlamaConfig(n_blocks=4), variant).graph) / 4
        for nb in args.blocks:
            cfg = LlamaConfig(n_blocks=nb)
            tg, build_s = best(lambda: build_train_step(cfg, variant))
            budget = int(per_block_ws * nb * args.fraction)
            mg, compile_s = best(lambda: compile_memory_graph(tg.graph, budget))
            _, check_s = best(lambda: check_race_free(mg))
            rows.append({"variant": variant, "blocks": nb, "task_vertices": len(tg.graph.vertices),
                         "memory_vertices": len(mg.vertices), "budget_gib": budget / 2**30, "build_s": build_s,
                         "compile_s": compile_s, "check_s": check_s,
                         "compile_s_per_1k_vertices": 1000 * compile_s / len(mg.vertices)})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    t = Table(title=f"training graph compile time, {args.fraction} of the working set")
    for c in ("variant", "blocks", "task vertices", "memory vertices", "budget GiB", "build s", "compile s",
              "check s", "compile s / 1k vertices"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["variant"], str(r["blocks"]), str(r["task_vertices"]), str(r["memory_vertices"]),
                  f"{r['budget_gib']:.1f}", f"{r['build_s']:.3f}", f"{r['compile_s']:.3f}", f"{r['check_s']:.3f}",
                  f"{r['compile_s_per_1k_vertices']:.3f}")
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
