"""Compile time of the memory-graph compiler against the number of blocks (issue 17: near-linear).

    python benchmarks/compile_time.py [--blocks 1 2 4 8 16 32 64] [--graphs prefill lora full]
                                      [--fraction 0.5] [--repeat 3] [--json]

For LLaMA-7B-wide blocks at 1 x 2048 (the prefill graph, and a LoRA and a full fine-tuning
training step), prints per (graph, blocks): task-graph and memory-graph vertices, the budget,
the bytes offloaded and reloaded, the seconds ``compile_memory_graph`` takes (best of ``--repeat``) and the seconds per
memory-graph vertex, which stays flat when compile time is linear. The budget is ``--fraction``
of the working set of 4 blocks, scaled to the block count (searching the working set of 64 blocks
would cost dozens of compiles), so every size offloads and reloads in the same proportion.
Times are the process's CPU time (``time.process_time``: the compile is single-threaded, and
CPU time leaves out what other processes take on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from rich.console import Console
from rich.table import Table

from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, build_llama
from vmstoolkit.exec.train_graph import build_train_step

GRAPHS = ("prefill", "lora", "full")


def build(graph: str, blocks: int) -> TaskGraph:
    cfg = LlamaConfig(n_blocks=blocks)
    return build_llama(cfg) if graph == "prefill" else build_train_step(cfg, graph).graph


def measure(graph: str, blocks: int, per_block_bytes: float, fraction: float, repeat: int) -> dict:
    g = build(graph, blocks)
    budget = int(per_block_bytes * blocks * fraction)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        mg = compile_memory_graph(g, budget)
        best = min(best, time.process_time() - t0)
    return {"graph": graph, "blocks": blocks, "task_vertices": len(g.vertices), "vertices": len(mg.vertices),
            "budget_gib": budget / 2**30, "moved_gib": (mg.offloaded_bytes + mg.reloaded_bytes) / 2**30, "compile_s": best,
            "s_per_vertex": best / len(mg.vertices)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--graphs", nargs="+", choices=GRAPHS, default=list(GRAPHS))
    ap.add_argument("--fraction", type=float, default=0.5, help="budget: this fraction of the working set")
    ap.add_argument("--repeat", type=int, default=3, help="compiles per size; the fastest is kept")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args(argv)
    rows = []
    for graph in args.graphs:
        per_block = working_set(build(graph, 4)) / 4
        rows += [measure(graph, nb, per_block, args.fraction, args.repeat) for nb in args.blocks]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    t = Table(title=f"compile time, budget {args.fraction} of the working set, {platform.processor() or platform.machine()}")
    for c in ("graph", "blocks", "task vertices", "vertices", "budget GiB", "offload + reload GiB", "compile s",
              "s / vertex"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["graph"], str(r["blocks"]), str(r["task_vertices"]), str(r["vertices"]), f"{r['budget_gib']:.1f}",
                  f"{r['moved_gib']:.1f}", f"{r['compile_s']:.3f}", f"{r['s_per_vertex']:.2e}")
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
