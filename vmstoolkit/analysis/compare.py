"""Two runs, or one run under several allocators, side by side; and where the peak comes from.

:func:`peak_sites` reads the recorded Python frames of a snapshot: at the moment the recorded
program had the most bytes allocated, which code had allocated them. It works on the raw
snapshot dict (``load_snapshot_dict``), whose entries keep their ``frames``.
"""

from __future__ import annotations

from collections import defaultdict

NO_FRAMES = "<no frames recorded>"
LIBRARY_MARKERS = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen", "/lib/python3")
"""A frame whose file matches one of these belongs to a library; a site is the innermost frame of
the user's own code (else the innermost frame), which is what someone changes to lower a peak."""


def site_of(entry: dict) -> str:
    """``file:line (function)`` of the innermost user frame of a trace entry."""
    frames = entry.get("frames") or []
    if not isinstance(frames, list) or not frames:
        return NO_FRAMES
    chosen = next((f for f in frames if isinstance(f, dict)
                   and not any(m in str(f.get("filename", "")) for m in LIBRARY_MARKERS)), frames[0])
    if not isinstance(chosen, dict):
        return NO_FRAMES
    return f"{chosen.get('filename', '?')}:{chosen.get('line', '?')} ({chosen.get('name', '?')})"


def busiest_device(snapshot: dict) -> int:
    traces = snapshot.get("device_traces") or []
    return max(range(len(traces)), key=lambda d: len(traces[d]) if isinstance(traces[d], list) else -1) if traces else 0


def peak_sites(snapshot: dict, *, device: int | None = None, top: int = 10) -> tuple[int, list[tuple[str, int]]]:
    """(peak allocated bytes, the ``top`` sites by bytes live at that peak) of one device's trace.

    Two passes over the entries, O(events): the first finds the peak, the second rebuilds the
    live allocations at it. Frees of memory allocated before recording are ignored.
    """
    traces = snapshot.get("device_traces") or []
    device = busiest_device(snapshot) if device is None else device
    entries = [e for e in (traces[device] if device < len(traces) else []) if isinstance(e, dict)]
    free = "free_completed" if any(e.get("action") == "free_completed" for e in entries) else "free_requested"
    live: dict[int, int] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(entries):
        a = e.get("action")
        if a == "alloc":
            live[e.get("addr")] = int(e.get("size", 0))
            cur += live[e.get("addr")]
            if cur > peak:
                peak, peak_at = cur, i
        elif a == free and e.get("addr") in live:
            cur -= live.pop(e.get("addr"))
    held: dict[int, dict] = {}
    for e in entries[: peak_at + 1]:
        a = e.get("action")
        if a == "alloc":
            held[e.get("addr")] = e
        elif a == free:
            held.pop(e.get("addr"), None)
    by_site: dict[str, int] = defaultdict(int)
    for e in held.values():
        by_site[site_of(e)] += int(e.get("size", 0))
    return peak, sorted(by_site.items(), key=lambda kv: -kv[1])[:top]


def compare_sites(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Sites of two runs merged: (site, bytes in A, bytes in B), largest difference first."""
    da, db = dict(a), dict(b)
    return sorted(((s, da.get(s, 0), db.get(s, 0)) for s in dict.fromkeys([*da, *db])),
                  key=lambda t: -abs(t[2] - t[1]))
