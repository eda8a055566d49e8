"""Python-replay events/s of every allocator, best of 3, on the 4 caching traces (item 2 of issue 16).

Run in a checkout of each commit: `PYTHONPATH=<tree> python before_after.py` before the compiled
path existed, `... before_after.py new` after (it then passes compiled=False, so paged replays through
its Python protocol too)."""
import sys
from vmstoolkit.pools import make_allocator
from vmstoolkit.trace import bundled_trace_paths, load_trace, replay
KW = {"compiled": False} if sys.argv[1:] == ["new"] else {}
names = ["native", "gmlake", "vms", "pytorch-caching", "pytorch-expandable", "paged"]
for p in bundled_trace_paths():
    t = load_trace(p)
    row = {}
    for n in names:
        best = None
        for _ in range(3):
            a = make_allocator(n); r = replay(t, a, **KW); a.close()
            best = r.seconds if best is None else min(best, r.seconds)
        row[n] = r.events / best
    print(t.name, " ".join(f"{n}={row[n]:,.0f}" for n in names))
