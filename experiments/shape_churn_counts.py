"""Driver and slow-path work per step when every step's shapes change (issue 34, item 7), on the simulated driver.

    STEPS=18 python experiments/shape_churn_counts.py pytorch-caching pytorch-expandable \
        paged:aliases=true,slack_pages=64

SYNTHETIC workload (:mod:`vmstoolkit.trace.synthetic`, kind ``full``): a LLaMA-3-style decoder
(16 layers, hidden 2048, FFN 8192, vocab 128256, ``train_llama_gpu.py --model llama3-1b``'s
shape), batch from {4, 6, 8} and any sequence length 200..2048 drawn per step. Steps are found by
their input ids' allocation. Prints one JSON line per allocator: peak reserved and, per step after
the first, the driver's calls (``mem_alloc`` is the caching allocator's cudaMalloc) and, for
``paged`` (through its compiled hook, :class:`~vmstoolkit.integrations.hook_allocator.HookAllocator`),
its Python slow path's counts (``py.mapped``: slow-path calls that mapped pages).
"""
import json
import os
import random
import sys

from vmstoolkit.trace.synthetic import synthetic_trace, SyntheticConfig
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers import make_driver
STEPS = int(os.environ.get("STEPS", 8))
cfg = SyntheticConfig(layers=16, hidden=2048, ffn=8192, heads=32, vocab=128256, seqs=tuple(range(200, 2049)), steps=STEPS)
tr = synthetic_trace("full", seed=0, config=cfg)
ev = tr.alloc_free_events()
rng = random.Random(0); sizes = []
for _ in range(STEPS):
    B, S = rng.choice(cfg.batches), rng.choice(cfg.seqs); sizes.append(B * S * 8)
starts, j = [], 0
for i, e in enumerate(ev):
    if j < len(sizes) and e.action.value == "alloc" and e.size == sizes[j]:
        starts.append(i); j += 1
assert j == STEPS
def run(name, native=False, **opt):
    d = make_driver("sim")
    if native:
        from vmstoolkit.integrations.hook_allocator import HookAllocator
        a = HookAllocator(name, d, **opt); counts = lambda: a._hook.bridge(0).allocator.counts
    else:
        a = make_allocator(name, d, **opt); counts = lambda: getattr(a, "counts", {})
    live = {}; steps = []
    bounds = starts[1:] + [len(ev)]; i = 0
    for end in bounds:
        p, pc = dict(d.calls), dict(counts())
        for e in ev[i:end]:
            if e.action.value == "alloc":
                live[e.addr] = a.allocate(e.size, e.stream)
            elif e.addr in live:
                a.free(live.pop(e.addr))
        i = end
        c = {k: v - p.get(k, 0) for k, v in d.calls.items() if v - p.get(k, 0)}
        cc = {k: v - pc.get(k, 0) for k, v in counts().items() if v - pc.get(k, 0)}
        steps.append({**c, **{"py." + k: v for k, v in cc.items()}, "syncs": d.syncs})
    peak = a.stats().peak_reserved_bytes
    a.close()  # one compiled hook per process at a time: the next paged spec makes its own
    return {"mode": name, **opt, "native": native, "peak_GiB": round(peak / 2**30, 2), "per_step": steps[1:]}
for spec in sys.argv[1:]:
    name, _, o = spec.partition(":")
    opt = {}
    for kv in filter(None, o.split(",")):
        k, v = kv.split("="); opt[k] = {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v)
    print(json.dumps(run(name, native=name == "paged", **opt)))
