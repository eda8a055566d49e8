"""Replay of the real H200 traces: the headline figures of the stitching allocators."""

import pytest

from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.trace import bundled_trace_paths, recorded_stats, replay
from vmstoolkit.units import GiB

PATHS = bundled_trace_paths()


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name.split(".")[0])
def test_vms_reaches_097_and_beats_real_expandable_segments(path, bundled_trace):
    trace = bundled_trace(path)
    a = make_allocator("vms")
    r = replay(trace, a, touch=True)
    a._check()
    a.close()
    assert a.driver.is_empty()
    real = recorded_stats(path, "expandable")
    assert r.peak_allocated == max_live_requested(trace)
    assert r.utilization >= 0.97, f"{trace.name}: vms utilization {r.utilization:.4f}"
    assert r.utilization > real["util"], f"{trace.name}: vms {r.utilization:.4f} vs expandable {real['util']:.4f}"
    assert not r.oom and r.unmatched_frees == 0


def max_live_requested(trace):
    live, cur, peak = {}, 0, 0
    for e in trace.alloc_free_events():
        if e.action.value == "alloc":
            live[e.addr] = e.size
            cur += e.size
            peak = max(peak, cur)
        else:
            cur -= live.pop(e.addr)
    return peak


def test_oom_is_reported_with_the_event(traces_dir, bundled_trace):
    trace = bundled_trace(traces_dir / "llama-lora.caching.pickle.gz")
    a = make_allocator("vms", SimulatedDriver(capacity=4 * GiB))
    r = replay(trace, a)
    assert r.oom and r.oom_event is not None and "out of memory" in r.oom_message
    assert r.peak_reserved <= 4 * GiB
    a._check()
    a.close()
    assert a.driver.is_empty()


def test_timeline_and_check_every(traces_dir, bundled_trace):
    trace = bundled_trace(traces_dir / "llama-full.caching.pickle.gz")
    a = make_allocator("gmlake")
    r = replay(trace, a, timeline=True, check_every=5000)
    tl = r.timeline
    assert len(tl["allocated"]) == r.events == len(tl["reserved"])
    assert tl["allocated"].max() == r.peak_allocated and tl["reserved"].max() == r.peak_reserved
    assert (tl["reserved"] >= tl["allocated"]).all()
    a.close()
