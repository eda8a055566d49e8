"""``experiments/mempool_routes.py`` run as a script on a made-up snapshot where the routes part
ways: PyTorch's own allocator frees a cached segment and retries, a MemPool keeps it and runs out
of memory, and vmstoolkit installed globally needs no retry at all."""

import json
import subprocess
import sys
from pathlib import Path

from vmstoolkit.recording import write_snapshot
from vmstoolkit.units import MiB

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "mempool_routes.py"


def test_under_pressure_the_mempool_keeps_its_cached_segment(tmp_path):
    events = []
    for i, size in enumerate((40 * MiB, 60 * MiB)):  # a 40 MiB segment cached, then 60 MiB wanted
        events += [{"action": a, "addr": (i + 1) << 32, "size": size, "stream": 0, "time_us": 3 * i + k}
                   for k, a in enumerate(("alloc", "free_requested", "free_completed"))]
    trace = write_snapshot({"segments": [], "device_traces": [events]}, tmp_path / "two.pickle")
    p = subprocess.run([sys.executable, str(SCRIPT), "--traces", str(trace), "--headroom", "0.07", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {r["label"]: r for r in json.loads((tmp_path / "mempool_routes.json").read_text())["rows"]}
    assert {r["capacity"] for r in rows.values()} == {66 * MiB}  # 60 MiB x 1.07, rounded up to 2 MiB
    caching = rows["global pytorch-caching"]
    assert not caching["oom"] and caching["peak_reserved"] == 60 * MiB  # the 40 MiB went back, then 60 MiB
    for name in ("paged", "vms"):
        assert not rows[f"global {name}"]["oom"]
        pool = rows[f"mempool {name}"]
        assert pool["oom"] and pool["oom_event"] == 2 and pool["segments"] == 1
    assert (tmp_path / "mempool_routes.csv").read_text().count("\n") == len(rows) + 1
    assert "| mempool paged | OOM at event 2 of 4 |" in p.stdout
