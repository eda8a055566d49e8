"""Offload runtime at scale: compile and execute time against graph size (issue 15 item 14).

    python benchmarks/offload_executor_scale.py [--blocks 250 500 1000 2000 4000] [--shape tiny 7b]
                                                [--fraction 0.25]

For LLaMA prefill graphs of N decoder blocks, compiled under ``--fraction`` of the graph's total
tensor bytes (so that weights and activations are offloaded and reloaded all along), prints per
(shape, N): memory-graph vertices, reloads, compile seconds, race-check seconds, and host
seconds of one run of each executor on the sim backend (which does no arithmetic: the shapes
only set byte counts and so how many copies wait at once). Near-linear growth shows as a flat
"us / vertex" column. Shapes: ``7b`` (LLaMA-7B widths, 1 x 2048) and ``tiny`` (hidden 64, 16
tokens), where thousands of reloads are ready long before the copy stream can take them: the
case that made the old drain loop quadratic. Figures are host time on the machine that runs it.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from rich.console import Console
from rich.table import Table

from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import compile_memory_graph
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, build_llama


SHAPES = {"7b": {}, "tiny": {"seq": 16, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 128}}


def measure(shape: str, blocks: int, fraction: float) -> dict:
    g = build_llama(LlamaConfig(n_blocks=blocks, **SHAPES[shape]))
    budget = int(sum(t.nbytes for t in g.tensors) * fraction)
    t0 = time.perf_counter()
    mg = compile_memory_graph(g, budget)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_race_free(mg)
    check_s = time.perf_counter() - t0
    row = {"shape": shape, "blocks": blocks, "vertices": len(mg.vertices), "edges": mg.n_edges,
           "reloads": sum(v.kind == "reload" for v in mg.vertices),
           "compile_s": round(compile_s, 3), "check_s": round(check_s, 3)}
    for ex in ("event-driven", "fixed-order"):
        r = execute(mg, SimBackend(seed=0, jitter=0.05), ex)
        row[f"{ex}_s"] = round(r.host_s, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["tiny", "7b"])
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(argv)
    rows = [measure(s, b, args.fraction) for s in args.shape for b in args.blocks]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    t = Table(title=f"offload runtime at scale (sim backend, budget {args.fraction} of all tensor bytes; "
                    f"{platform.processor() or platform.machine()}, Python {platform.python_version()})")
    for c in ("shape", "blocks", "vertices", "reloads", "compile s", "race check s", "event-driven s",
              "us / vertex", "fixed-order s"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["shape"], str(r["blocks"]), str(r["vertices"]), str(r["reloads"]), f"{r['compile_s']:.2f}",
                  f"{r['check_s']:.2f}", f"{r['event-driven_s']:.2f}",
                  f"{1e6 * r['event-driven_s'] / r['vertices']:.1f}", f"{r['fixed-order_s']:.2f}")
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
