"""More GPUs than the machine has (issue 32, item 9): LLaMA-2-7B prefill on 1, 2, 4 and 8
simulated GPUs, each GPU with its own host link or all of them sharing one, as a pipeline and
as data-parallel replicas.

    python experiments/multi_gpu_sim.py --out experiments/results/multi-gpu-sim

The model: 32 LLaMA-2-7B blocks (hidden 4096, 32 heads, FFN 11008), fp32, batch 1, prefill of
``--seq`` tokens (2048 and 512), in two layouts:

- ``pipeline``: N stages of contiguous blocks (``build_llama(n_gpus=N)``): one micro-batch, so
  the GPUs take turns and compute does not shrink with N; what N buys is memory (N budgets) and
  N copy engines. Each GPU's budget is a fraction (1/2, 1/4) of its own stage's no-offload
  working set, so every N reloads about the same bytes in all.
- ``replicas``: N copies of the whole model, one per GPU, each prefilling its own prompt at once
  (data parallel: N times the work, every GPU streaming the same weights from the host at the
  same time). Each GPU's budget is the fraction of the whole model's working set. Per row, the sim backend with the H200's costs (``CostModel.h200``): the
event-driven step with a host link per GPU (PCIe x16 each, 54 GB/s each way) and with one link
of 54 GB/s each way shared by all (``host_link_bytes_per_s``: one PCIe switch or root port in
front of them), mean of 3 seeds, jitter 5%, and the bound max(compute, copies) of the shared
case. Writes ``<out>/multi_gpu_sim.jsonl`` and ``<out>/README.md``'s table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from vmstoolkit.exec.backends.sim import CostModel, SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, build_llama

LLAMA2_7B = LlamaConfig(n_blocks=32, hidden=4096, heads=32, kv_heads=32, ffn=11008)
LINK = 54e9


def replicas(g1: TaskGraph, n: int) -> TaskGraph:
    """``n`` copies of the one-GPU graph ``g1``, copy ``i`` on GPU ``i``."""
    g = TaskGraph()
    for i in range(n):
        tid = {t.id: g.tensor(f"r{i}.{t.name}", t.shape, t.dtype, i, t.kind) for t in g1.tensors}
        for v in g1.vertices:
            g.add(f"r{i}.{v.name}", v.op, [tid[t] for t in v.inputs], [tid[t] for t in v.outputs], gpu=i,
                  params=v.params, views=v.views, flops=v.flops)
        g.outputs += [tid[t] for t in g1.outputs]
    return g


def row(layout: str, seq: int, n: int, frac: float) -> dict:
    cfg = replace(LLAMA2_7B, seq=seq)
    g = build_llama(cfg, parts=1, n_gpus=n) if layout == "pipeline" else replicas(build_llama(cfg), n)
    budget = int(working_set(g) * frac)  # working_set of an N-GPU graph: the most any GPU needs
    mg = compile_memory_graph(g, budget)
    own, shared = CostModel.h200(), CostModel.h200(host_link_bytes_per_s=LINK)
    out = {"layout": layout, "seq": seq, "gpus": n, "budget_fraction": frac, "budget_per_gpu": budget,
           "reloaded_bytes": mg.reloaded_bytes, "vertices": len(mg.vertices)}
    for name, cost in (("own_links", own), ("shared_link", shared)):
        spans = [execute(mg, SimBackend(cost, seed=s, jitter=0.05), "event-driven").makespan_s for s in range(3)]
        lb = cost.lower_bound(mg)
        out[f"{name}_s"] = float(np.mean(spans))
        out[f"{name}_bound_s"] = lb["lower_bound_s"]
        out[f"{name}_h2d_s"] = lb["h2d_s"]
    out["compute_s"] = lb["compute_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--layouts", nargs="+", choices=("pipeline", "replicas"), default=["pipeline", "replicas"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    print("| layout | seq | GPUs | budget per GPU | reloaded GB | compute s | own links: step s | shared link: step s "
          "| shared-link bound s (H2D s) | shared / own |")
    print("|---" * 10 + "|")
    for layout in a.layouts:
        for seq in a.seq:
            for frac in a.fractions:
                for n in a.gpus:
                    r = row(layout, seq, n, frac)
                    rows.append(r)
                    print(f"| {layout} | {seq} | {n} | {frac} ({r['budget_per_gpu'] / 2**30:.2f} GiB) | "
                          f"{r['reloaded_bytes'] / 1e9:.1f} | {r['compute_s']:.3f} | {r['own_links_s']:.3f} | "
                          f"{r['shared_link_s']:.3f} | {r['shared_link_bound_s']:.3f} ({r['shared_link_h2d_s']:.3f}) | "
                          f"{r['shared_link_s'] / r['own_links_s']:.2f} |", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "multi_gpu_sim.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"command": " ".join(sys.argv), **r}) + "\n")


if __name__ == "__main__":
    main()
