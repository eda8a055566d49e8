"""How memory-graph compile time grows with graph size (prints a table; not a timed test).

    python experiments/offload_compile_bench.py [--budget-fraction 0.25]

For LLaMA-7B-wide stacks of 4..64 blocks, partitioned into 1, 8 or 32 parts, compile at a
budget of a fraction of the weights and run the race checker; prints vertices, edges before and
after the transitive reduction, seconds to compile and seconds to check.
"""

from __future__ import annotations

import argparse
import json
import time

from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import compile_memory_graph
from vmstoolkit.exec.graph import LlamaConfig, build_llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--sizes", default="4,8,16,32,64")
    ap.add_argument("--parts", default="1,8,32")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    a = ap.parse_args()
    if not a.json:
        print(f"{'blocks':>6} {'parts':>5} {'task V':>7} {'mem V':>7} {'E before':>9} {'E after':>8} "
              f"{'build s':>8} {'compile s':>9} {'check s':>8} {'us/vertex':>9}")
    for parts in map(int, a.parts.split(",")):
        for nb in map(int, a.sizes.split(",")):
            t0 = time.perf_counter()
            g = build_llama(LlamaConfig(n_blocks=nb), parts=parts)
            t1 = time.perf_counter()
            mg = compile_memory_graph(g, int(g.weight_bytes() * a.budget_fraction))
            t2 = time.perf_counter()
            check_race_free(mg)
            t3 = time.perf_counter()
            row = {"blocks": nb, "parts": parts, "task_vertices": len(g.vertices), "vertices": len(mg.vertices),
                   "edges_before": mg.edges_before_reduction, "edges": mg.n_edges, "build_s": t1 - t0,
                   "compile_s": t2 - t1, "check_s": t3 - t2}
            if a.json:
                print(json.dumps(row))
            else:
                print(f"{nb:>6} {parts:>5} {len(g.vertices):>7} {len(mg.vertices):>7} {mg.edges_before_reduction:>9} "
                      f"{mg.n_edges:>8} {t1 - t0:>8.2f} {t2 - t1:>9.2f} {t3 - t2:>8.2f} "
                      f"{1e6 * (t2 - t1) / len(mg.vertices):>9.1f}")


if __name__ == "__main__":
    main()
