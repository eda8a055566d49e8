"""Where a simulated step loses time (issue 32, item 7): one rule shape of
``results/untuned-shapes/RULE.md`` at one budget, one event-driven run on the sim backend without
jitter, then its compute stream's idle gaps and its host-to-device stream's idle gaps, each with
the vertex it waited for and why that one started when it did.

    python experiments/untuned_critical_path.py Yi-34B 0.25                 # no host cost (as found)
    python experiments/untuned_critical_path.py Mistral 0.25 --host-costs   # the H200's host costs
    python experiments/untuned_critical_path.py Yi-34B 0.25 --no-prefetch   # the graph of before

A compute gap names the latest-ending predecessor of the vertex after it, and that one's own
predecessors with their edge kinds (``reuse``: it waited for the bytes it overwrites) and end
times; a copy gap names the copy after it and its latest-ending predecessor.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from vmstoolkit.exec.backends.sim import CostModel, SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.train_graph import build_train_step

_spec = importlib.util.spec_from_file_location("untuned_shapes", Path(__file__).with_name("untuned_shapes.py"))
us = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", help="a prefix of a rule shape's name, or 'issue'")
    ap.add_argument("budget", type=float, help="fraction of the working set")
    ap.add_argument("--host-costs", action="store_true", help="CostModel.h200() as is (default: no host cost)")
    ap.add_argument("--no-prefetch", action="store_true", help="compile with prefetch=False")
    ap.add_argument("--min-gap-ms", type=float, default=0.3)
    a = ap.parse_args()
    s = next(x for x in [us.ISSUE, *us.shapes()] if x[0].startswith(a.shape))
    g = build_train_step(us.config(s), "lora", rank=us.RANK).graph
    mg = compile_memory_graph(g, int(working_set(g) * a.budget), prefetch=not a.no_prefetch)
    cost = CostModel.h200() if a.host_costs else CostModel.h200(launch_s=0, notify_s=0, launch_s_by_op=())
    lb = cost.lower_bound(mg)["lower_bound_s"]
    be = SimBackend(cost, jitter=0)
    r = execute(mg, be, "event-driven")
    fo = execute(mg, SimBackend(cost, jitter=0), "fixed-order").makespan_s
    print(f"{s[0]} at {a.budget}: event-driven {r.makespan_s * 1e3:.1f} ms ({r.makespan_s / lb:.3f}x its bound), "
          f"fixed-order {fo * 1e3:.1f} ms ({fo / lb:.3f}x); {mg.reloaded_bytes / 1e9:.2f} GB reloaded")
    span = {v: (st, en, stream) for v, _, stream, st, en in be.spans}
    verts = mg.vertices

    def end(u):
        return span[u][1]

    for stream in ("compute", "h2d"):
        runs = sorted((st, en, v) for v, (st, en, k) in span.items() if k == stream)
        total = 0.0
        for (_, e0, _), (s1, _, v1) in zip(runs, runs[1:]):
            if s1 - e0 < a.min_gap_ms * 1e-3 or not mg.preds[v1]:
                continue
            total += s1 - e0
            u = max(mg.preds[v1], key=end)
            why = ", ".join(f"{verts[x].name} ({mg.kinds.get((x, u))}, ends {end(x) * 1e3:.2f})" for x in mg.preds[u])
            print(f"  {stream} idle {(s1 - e0) * 1e3:6.2f} ms at {e0 * 1e3:8.2f}: {verts[v1].name} waits "
                  f"{verts[u].name} [{span[u][0] * 1e3:.2f}, {end(u) * 1e3:.2f}]" + (f" <- {why}" if why else ""))
        print(f"{stream}: {total * 1e3:.1f} ms idle in gaps of at least {a.min_gap_ms} ms")


if __name__ == "__main__":
    main()
