"""Snapshot loading: time and peak RSS of ``load_trace`` against ``pickle.load``, and of hostile files.

    python benchmarks/loader_bench.py [--sizes 100000,500000,2000000] [--skip-hostile] [--dir DIR]
                                      [--allocators paged,pytorch-caching,vms]

(a) Generated snapshots of N entries with 5 frames each (as ``_dump_snapshot`` writes them:
    one pickle, frame dicts made per entry, file names and function names shared). Each load runs
    in its own subprocess, so its peak RSS (``VmHWM``) is its own: ``pickle.load`` of the
    file, then ``vmstoolkit.trace.load_trace`` of the same file (typed events, pre-existing
    memory and corrupt-trace checks included). Times are of the load call alone; the RSS
    includes the interpreter and imports (numpy and numba for ours: about 90 MB).
    Then, one subprocess per allocator of ``--allocators``, load and replay: ``load_trace`` and
    a replay (``paged`` through its compiled path, all on the compiled simulated driver),
    against the same ``pickle.load``, and each allocator's events/s against
    ``pytorch-caching``'s on the same file: the issue 36 aims are load + replay at most
    ``pickle.load``'s time, under 600 MB, and at least 1M events/s in ``paged``'s replay.
(b) Hostile files, built here and never checked in: each must end in a one-line
    ``TraceFormatError`` quickly and with bounded memory.

Printed figures only; nothing is asserted (see tests/trace/test_loader.py for the behaviour).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, resource, sys, time
mode, path = sys.argv[1], sys.argv[2]
out = {}
if mode == "pickle":
    import pickle
    t, c = time.perf_counter(), time.process_time()
    with open(path, "rb") as f:
        obj = pickle.load(f)
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t, time.process_time() - c
else:
    from vmstoolkit.errors import TraceFormatError
    from vmstoolkit.trace import load_trace
    t, c = time.perf_counter(), time.process_time()
    try:
        tr = load_trace(path)
        out["events"] = len(tr.events)
    except TraceFormatError as e:
        out["error"] = str(e)
    out["seconds"], out["cpu_seconds"] = time.perf_counter() - t, time.process_time() - c
    if mode.startswith("replay:") and "error" not in out:
        from vmstoolkit.pools import make_allocator
        from vmstoolkit.trace import replay
        a = make_allocator(mode.split(":", 1)[1])
        c = time.process_time()
        r = replay(tr, a)
        out["replay_cpu_seconds"] = time.process_time() - c
        a.close()
        out["replay_seconds"] = r.seconds
        out["replay_events_per_second"] = r.events_per_second
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork and exec, so a child would report its parent's peak
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
out["peak_rss_mb"] = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


BASE = "pytorch-caching"


def measure(mode: str, path: Path, timeout: float = 900) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, mode, str(path)], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200], "rc": r.returncode}
    return json.loads(r.stdout)


def generate(n: int, path: Path, seed: int = 0) -> None:
    """A snapshot of ``n`` entries (allocs and frees, one device), 5 frames each."""
    rng = random.Random(seed)
    files = [f"/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module_{i}.py" for i in range(200)]
    names = [f"forward_{i}" for i in range(300)]
    entries, live, addr, t = [], [], 1 << 40, 1_700_000_000_000_000
    for _ in range(n):
        if live and rng.random() < 0.5:
            a, s = live.pop(rng.randrange(len(live)))
            act = "free_completed"
        else:
            s = rng.choice([512, 4096, 1 << 20, 3 << 20, rng.randrange(1, 1 << 26)])
            a, act = addr, "alloc"
            addr += (s + 511) // 512 * 512
            live.append((a, s))
        t += rng.randrange(1, 50)
        frames = [{"filename": rng.choice(files), "line": rng.randrange(1, 3000), "name": rng.choice(names)}
                  for _ in range(5)]
        entries.append({"action": act, "addr": a, "size": s, "stream": 0, "time_us": t, "frames": frames,
                        "compile_context": "N/A", "user_metadata": ""})
    snap = {"segments": [], "device_traces": [entries], "allocator_settings": {"expandable_segments": False},
            "external_annotations": []}
    with open(path, "wb") as f:
        pickle.dump(snap, f)


def hostile(d: Path) -> dict[str, Path]:
    """The attack files of issue 15, item 9, and a few more."""
    files: dict[str, Path] = {}

    def put(name: str, raw: bytes) -> None:
        (d / name).write_bytes(raw)
        files[name] = d / name

    # 3 MB of gzip holding 3 GiB of a valid, endless pickle stream (NONE, POP, ...)
    with gzip.open(d / "bomb-3MB.pickle.gz", "wb", compresslevel=9) as f:
        f.write(b"\x80\x02")
        block = b"N0" * (1 << 20)
        for _ in range(1536):
            f.write(block)
    files["bomb-3MB.pickle.gz"] = d / "bomb-3MB.pickle.gz"
    # 10 MB of gzip holding zeros (not even a pickle)
    with gzip.open(d / "bomb-zeros.pickle.gz", "wb", compresslevel=9) as f:
        z = bytes(1 << 20)
        for _ in range(10240):
            f.write(z)
    files["bomb-zeros.pickle.gz"] = d / "bomb-zeros.pickle.gz"
    put("bytearray-2GiB.pickle", b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R.")  # 32 bytes
    e = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}
    put("one-dict-10M-refs.pickle.gz", gzip.compress(pickle.dumps({"device_traces": [[e] * 10_000_000]}), 9))
    # distinct entries that compress well: the bomb that looks like a real trace
    raw = pickle.dumps({"device_traces": [[dict(e) for _ in range(3_000_000)]]})
    put("distinct-3M-entries.pickle.gz", gzip.compress(raw, 9))
    depth = 1_000_000
    put("nested-1M.pickle", b"\x80\x04}\x8c\x0ddevice_traces]]" + b"]" * depth + b"K\x01" + b"a" * depth + b"aas.")
    put("long-string-1GiB.pickle.gz", gzip.compress(b"\x80\x04\x8d" + (1 << 30).to_bytes(8, "little") + b"x" * (64 << 20), 9))
    fifo = d / "fifo.pickle"
    os.mkfifo(fifo)
    files["fifo.pickle"] = fifo
    files["/dev/zero"] = Path("/dev/zero")
    return files


def print_replays(replays: list[tuple[int, dict, dict]]) -> None:
    """The load + replay table: per snapshot and allocator, times against ``pickle.load``'s,
    peak RSS, and events/s against ``pytorch-caching``'s on the same file."""
    print("\n    load + replay (one subprocess each), against pickle.load of the same file (wall and CPU time: "
          "on a shared machine the CPU ratio is the honest one)")
    print(f"{'entries':>9} {'allocator':<16} | {'pickle.load s':>13} | {'load s':>7} {'replay s':>8} {'total s':>8} "
          f"{'/pickle':>7} {'CPU /pickle':>11} {'RSS MB':>7} | {'replay ev/s':>11} {'vs caching':>10}")
    for n, pk, runs in replays:
        base = runs.get(BASE, {}).get("replay_events_per_second", float("nan"))
        for name, rp in runs.items():
            if "error" in rp:
                print(f"{n:>9} {name:<16} | {rp['error']}")
                continue
            total = rp["seconds"] + rp["replay_seconds"]
            cpu = (rp["cpu_seconds"] + rp["replay_cpu_seconds"]) / pk.get("cpu_seconds", float("nan"))
            print(f"{n:>9} {name:<16} | {pk.get('seconds', float('nan')):>13.2f} | {rp['seconds']:>7.2f} "
                  f"{rp['replay_seconds']:>8.2f} {total:>8.2f} {total / pk.get('seconds', float('nan')):>6.2f}x "
                  f"{cpu:>10.2f}x "
                  f"{rp['peak_rss_mb']:>7.0f} | {rp['replay_events_per_second']:>11,.0f} "
                  f"{rp['replay_events_per_second'] / base:>9.2f}x", flush=True)


def machine() -> str:
    return (f"{platform.node()}: {platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,500000,2000000")
    ap.add_argument("--skip-hostile", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="where to build the files (default: a temporary folder)")
    ap.add_argument("--allocators", default=f"paged,{BASE}",
                    help=f"allocators replayed after the load, each in its own subprocess ({BASE} is always added)")
    args = ap.parse_args()
    allocators = [a for a in args.allocators.split(",") if a]
    if BASE not in allocators:
        allocators.append(BASE)
    if args.dir is not None:
        try:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--dir {args.dir}: cannot make it: {e.strerror}")
    print(f"machine: {machine()}")
    print(f"command: python benchmarks/loader_bench.py {' '.join(sys.argv[1:])}".rstrip())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        measure("ours", ROOT / "vmstoolkit" / "data" / "traces" / "llama-full.caching.pickle.gz")  # warm numba's cache
        replays = []
        print("\n(a) generated snapshots, 5 frames per entry")
        print(f"{'entries':>9} {'file MB':>8} {'gzip x':>7} | {'pickle.load s':>13} {'RSS MB':>7} | "
              f"{'load_trace s':>12} {'RSS MB':>7} | {'speed-up':>8}")
        for n in (int(x) for x in args.sizes.split(",")):
            p = d / f"gen-{n}.pickle"
            generate(n, p)
            size = p.stat().st_size
            ratio = size / len(gzip.compress(p.read_bytes()[: 32 << 20], 6)) if n <= 100_000 else float("nan")
            pk = measure("pickle", p)
            ours = measure("ours", p)
            assert ours.get("events") == n, ours
            print(f"{n:>9} {size / 1e6:>8.1f} {ratio:>7.1f} | {pk.get('seconds', float('nan')):>13.2f} "
                  f"{pk.get('peak_rss_mb', float('nan')):>7.0f} | {ours['seconds']:>12.2f} {ours['peak_rss_mb']:>7.0f} | "
                  f"{pk.get('seconds', float('nan')) / ours['seconds']:>7.1f}x", flush=True)
            replays.append((n, pk, {a: measure(f"replay:{a}", p) for a in allocators}))
            p.unlink()
        print_replays(replays)
        if args.skip_hostile:
            return
        print("\n(b) hostile files: load_trace")
        print(f"{'file':<30} {'size':>9} | {'seconds':>7} {'RSS MB':>7} | error")
        for name, p in hostile(d).items():
            size = p.stat().st_size if p.is_file() else 0
            r = measure("ours", p, timeout=120)
            err = r.get("error", "(loaded!)")
            err = err.replace(str(d) + "/", "")
            print(f"{name:<30} {size:>9} | {r.get('seconds', float('nan')):>7.2f} {r.get('peak_rss_mb', float('nan')):>7.0f} "
                  f"| {err[:150]}", flush=True)


if __name__ == "__main__":
    main()
