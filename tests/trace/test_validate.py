"""Corrupt traces are errors (or skipped and counted), memory from before recording is made first."""

import pytest

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.pools import make_allocator
from vmstoolkit.trace import load_trace, replay
from vmstoolkit.units import MiB


def _snap(entries, segments=()):
    return {"device_traces": [entries], "segments": list(segments)}


def a(addr, size, t=0):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t}


def f(addr, size, t=0):
    return {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "time_us": t}


@pytest.mark.parametrize("entries, kind, match", [
    ([a(0x1000, MiB), a(0x1000, MiB)], "double_alloc",
     r"second alloc at live address 0x1000 at event 1 \(allocated at event 0\)"),
    ([a(0x100000, 2 * MiB), a(0x200000, MiB)], "overlap",
     r"event 1 allocates \[0x200000, \+1048576\) overlapping the live \[0x100000, \+2097152\) allocated at event 0"),
    ([a(0x200000, MiB), a(0x100000, 2 * MiB)], "overlap", r"event 1 allocates \[0x100000, \+2097152\) overlapping"),
    ([a(0x1000, MiB), f(0x1000, 512)], "size_mismatch",
     r"event 1 frees 512 bytes at 0x1000, allocated with 1048576 bytes at event 0"),
    ([a(0x1000, MiB), f(0x1000, MiB), f(0x1000, MiB)], "double_free",
     r"double free of address 0x1000 at event 2 \(already freed at event 1\)"),
])
def test_corrupt_traces_are_errors_or_skipped(entries, kind, match):
    entries = entries + [a(1 << 40, 4096)]
    with pytest.raises(TraceFormatError, match=match + ".*--lenient"):
        load_trace(_snap(entries))
    t = load_trace(_snap(entries), lenient=True)
    assert t.skipped == {kind: 1} and len(t.events) == len(entries) - 1
    alloc = make_allocator("pytorch-caching")
    r = replay(t, alloc)
    assert r.skipped_events == 1 and not r.oom
    alloc._check()
    alloc.close()


def test_memory_from_before_recording_is_made_first():
    # 0x10000000 is freed but never allocated in the trace; 0x40000000 is live in the segments
    seg = {"device": 0, "address": 0x40000000, "stream": 0, "total_size": 20 * MiB,
           "blocks": [{"address": 0x40000000, "size": 8 * MiB, "requested_size": 7 * MiB, "state": "active_allocated"},
                      {"address": 0x40800000, "size": 12 * MiB, "requested_size": 0, "state": "inactive"}]}
    t = load_trace(_snap([a(0x1000, MiB), f(0x10000000, 3 * MiB), f(0x1000, MiB)], [seg]))
    assert [(e.addr, e.size) for e in t.preexisting] == [(0x10000000, 3 * MiB), (0x40000000, 7 * MiB)]
    assert t.preexisting_bytes == 10 * MiB
    alloc = make_allocator("vms")
    r = replay(t, alloc)
    assert r.preexisting_bytes == 10 * MiB and r.unmatched_frees == 1
    assert r.peak_allocated == 11 * MiB  # pre-existing 10 MiB live with the trace's first MiB
    alloc.close()
    alloc = make_allocator("vms")
    r = replay(t, alloc, preexisting=False)
    assert r.preexisting_bytes == 0 and r.unmatched_frees == 1 and r.peak_allocated == MiB
    alloc.close()


def test_a_trace_alloc_overlapping_preexisting_memory_is_corrupt():
    with pytest.raises(TraceFormatError, match=r"event 0 allocates \[0x10100000.*allocated before recording"):
        load_trace(_snap([a(0x10100000, MiB), f(0x10000000, 3 * MiB)]))
