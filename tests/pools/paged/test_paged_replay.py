"""The compiled replay of ``paged`` (vmstoolkit/pools/paged/replay.py) gives what the Python
replay gives, to the byte: result, timeline, and the allocator's state afterwards."""

import random
from pathlib import Path

import numpy as np
import pytest

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.base import ReplayArrays
from vmstoolkit.pools.paged.replay import match_frees
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.trace import replay
from vmstoolkit.trace.events import Action, Trace, TraceEvent
from vmstoolkit.trace.replay import event_arrays
from vmstoolkit.trace.synthetic import synthetic_trace
from vmstoolkit.units import GiB, MiB

TRACES = sorted((Path(__file__).parents[3] / "vmstoolkit" / "data" / "traces").glob("*.pickle.gz"))
OPTIONS = [{}, {"aliases": True, "slack_pages": 64}]


def _state(a):
    """Everything a later call could see of the allocator."""
    heaps = {f"{name}.{i}": arr.copy() for name, h in (("large", a.large), ("small", a.small))
             for i, arr in enumerate(h.arrays())}
    return {"stats": a.stats().as_dict(), "live": list(a._live.items()), "counts": a.path_counts(),
            "home": a._streams.home, "stream_of": dict(a._streams.stream_of), "slots": dict(a._slot),
            "g": a.g.copy(), "tags": a.chunk_tag.copy(), "stack": a.chunk_stack.copy(), "nmaps": a.nmaps.copy(),
            "num_ooms": a._num_ooms, "handles": len(a.handles), **heaps}


def _same(x, y):
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def both(trace, options=None, driver=None, **kw):
    """Replay through the protocol and through the compiled path; assert they agree."""
    runs = []
    for compiled in (False, True):
        a = make_allocator("paged", driver() if driver else None, **(options or {}))
        r = replay(trace, a, compiled=compiled, timeline=True, **kw)
        a._check()
        runs.append((r, a))
    (r0, a0), (r1, a1) = runs
    d0, d1 = r0.as_dict(), r1.as_dict()
    for d in (d0, d1):
        d.pop("seconds"), d.pop("events_per_second")
    assert d0 == d1
    assert _same(r0.timeline, r1.timeline)
    s0, s1 = _state(a0), _state(a1)
    assert s0.keys() == s1.keys()
    for k in s0:
        assert _same(s0[k], s1[k]), k
    for a in (a0, a1):
        a.close()
        assert a.driver.is_empty()
    return r1


# Every bundled trace once, each workload under both option sets: its caching-allocator recording
# with the defaults, its expandable-segments one with aliases (the two recordings of one workload
# differ in addresses and timing, not in the pattern); the frames trace under both. All 17 pairs
# took 18 s of the suite's CPU; the synthetic and random traces below take both options.
BUNDLED = [(p, o) for p in TRACES for i, o in enumerate(OPTIONS)
           if ".frames." in p.name or (i == 1) == (".expandable." in p.name)]


@pytest.mark.slow
@pytest.mark.parametrize("path, options", BUNDLED,
                         ids=[f"{p.name.split('.pickle')[0]}-{'aliases' if o else 'default'}" for p, o in BUNDLED])
def test_every_bundled_trace(path, options, bundled_trace):
    r = both(bundled_trace(path), options)
    floor = 10000 if ".frames." in path.name else 20000  # the frames trace is four short steps of a small model
    assert r.events > floor and not r.oom


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "aliases"])
@pytest.mark.parametrize("kind", ["full", "lora", "offload", "seqgrow"])
def test_synthetic_traces(kind, options):
    both(synthetic_trace(kind, seed=3, steps=3), options)


def _random_trace(seed, n=6000, streams=(0, 7, 9), pre=20):
    """Allocs and frees of random sizes on several streams (frees sometimes on another stream),
    with memory live before recording, frees of memory never seen, and leaked addresses."""
    rng = random.Random(seed)
    ev, live, freed, t = [], [], [], 0
    addr = 1 << 40
    pre_ev = []
    for _ in range(pre):
        addr += 1 << 26
        pre_ev.append(TraceEvent(Action.ALLOC, addr, rng.choice([4096, 3 * MiB, 40 * MiB]), 0, 0))
    live += [(e.addr, e.stream) for e in pre_ev]
    for e in pre_ev[: pre // 4]:  # allocated again before any free (the first leaks); its free counts as unmatched
        live.remove((e.addr, e.stream))
        freed.append(e.addr)
    for _ in range(n):
        t += 1
        if live and rng.random() < 0.48:
            a, s = live.pop(rng.randrange(len(live)))
            s = s if rng.random() < 0.9 else rng.choice(streams + (99,))  # 99: a stream that only frees
            ev.append(TraceEvent(Action.FREE_COMPLETED, a, 0, s, t))
            freed.append(a)
        elif rng.random() < 0.01:
            ev.append(TraceEvent(Action.FREE_COMPLETED, 12345 * 512, 0, 0, t))  # allocated before recording
        else:
            addr += 1 << 27
            a = addr
            if freed and rng.random() < 0.3:
                a = freed.pop(rng.randrange(len(freed)))  # an address used before (or before recording)
            elif live and rng.random() < 0.005:
                a = live.pop(rng.randrange(len(live)))[0]  # allocated again while live: the first one leaks
            size = rng.choice([512, 700, 8192, 1 * MiB, 1 * MiB + 1, 2 * MiB, 5 * MiB, 64 * MiB, rng.randrange(1, 200 * MiB)])
            s = rng.choice(streams)
            ev.append(TraceEvent(Action.ALLOC, a, size, s, t))
            if rng.random() < 0.97:
                live.append((a, s))
    return Trace(name=f"random-{seed}", events=tuple(ev), preexisting=tuple(pre_ev))


@pytest.mark.parametrize("options", OPTIONS + [{"max_blocks": 16, "reclaim": "clock", "large_unit": 512 * 1024}],
                         ids=["default", "aliases", "records"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_streams_preexisting_and_unmatched(seed, options):
    r = both(_random_trace(seed), options, driver=lambda: SimulatedDriver(capacity=8 * GiB))
    assert r.unmatched_frees > 20 and r.preexisting_bytes > 0


def test_out_of_memory_stops_at_the_same_event():
    r = both(_random_trace(4, pre=0), {}, driver=lambda: SimulatedDriver(capacity=1 * GiB))
    assert r.oom and r.oom_event > 0


def _driver_state(d):
    return {"calls": dict(d.calls), "mappings": d.live_mappings(), "handles": sorted(d.live_handles()),
            "physical": (d.physical_bytes, d.peak_physical_bytes), "syncs": d.syncs, "sizes": dict(d._handle_sizes)}


@pytest.mark.parametrize("seed, capacity", [(1, 8 * GiB), (4, 1 * GiB)], ids=["streams", "oom"])
def test_the_compiled_driver_work_is_the_python_path(seed, capacity, monkeypatch):
    """On the compiled simulated driver, the compiled replay maps pages in its loop
    (pools/paged/driver_work.py), the Python map_block only for the few blocks the loop hands
    back; the replay, the allocator and the driver end as after the Python replay (calls,
    mappings, handles, bytes, syncs)."""
    from vmstoolkit.pools.drivers.compiled import CompiledSimulatedDriver
    from vmstoolkit.pools.paged.allocator import PagedAllocator

    trace = _random_trace(seed, pre=0)  # memory live before recording is allocated through Python
    a0 = make_allocator("paged", CompiledSimulatedDriver(capacity=capacity))
    r0 = replay(trace, a0, compiled=False, timeline=True)
    mapped = []
    real = PagedAllocator.map_block
    monkeypatch.setattr(PagedAllocator, "map_block", lambda self, *a: mapped.append(a) or real(self, *a))
    a1 = make_allocator("paged", CompiledSimulatedDriver(capacity=capacity))
    r1 = replay(trace, a1, compiled=True, timeline=True)
    # Python: the first block (it reserves the ranges), a stream's first (its slot is given there)
    assert len(mapped) <= 4 and a1.counts["mapped"] > 50
    d0, d1 = r0.as_dict(), r1.as_dict()
    for d in (d0, d1):
        d.pop("seconds"), d.pop("events_per_second")
    assert d0 == d1 and _same(r0.timeline, r1.timeline)
    assert (capacity < 2 * GiB) == bool(r1.oom)
    s0, s1 = _state(a0), _state(a1)
    for k in s0:
        assert _same(s0[k], s1[k]), k
    assert a0.handles == a1.handles
    assert _driver_state(a0.driver) == _driver_state(a1.driver)
    for a in (a0, a1):
        a._check()
        a.close()
        assert a.driver.is_empty()


def test_a_request_larger_than_the_device():
    ev = (TraceEvent(Action.ALLOC, 4096, 1 * MiB, 0, 1), TraceEvent(Action.ALLOC, 8192, 3 * GiB, 0, 2))
    r = both(Trace(name="huge", events=ev), {}, driver=lambda: SimulatedDriver(capacity=2 * GiB))
    assert r.oom and r.oom_event == 1 and "larger than the device" in r.oom_message


def test_double_free_is_the_same_error():
    ev = (TraceEvent(Action.ALLOC, 4096, 1 * MiB, 0, 1), TraceEvent(Action.FREE_COMPLETED, 4096, 0, 0, 2),
          TraceEvent(Action.FREE_COMPLETED, 4096, 0, 0, 3))
    msgs = []
    for compiled in (False, True):
        with pytest.raises(TraceFormatError) as e:
            replay(Trace(name="dbl", events=ev), make_allocator("paged"), compiled=compiled)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "at event 2 (already freed at event 1)" in msgs[0]


def test_progress_is_called_at_the_same_events():
    trace = _random_trace(5, n=3000)
    calls = []
    for compiled in (False, True):
        seen = []
        replay(trace, make_allocator("paged"), compiled=compiled, progress=seen.append, progress_every=700)
        calls.append(seen)
    assert calls[0] == calls[1] and calls[0][:2] == [700, 1400]


def test_touch_and_check_every_replay_through_the_protocol():
    calls = []

    class Spy(type(make_allocator("paged"))):
        def compiled_replay(self, events: ReplayArrays):
            calls.append(len(events.addr))
            return super().compiled_replay(events)

    trace = synthetic_trace("lora", seed=1, steps=1)
    replay(trace, Spy(SimulatedDriver()), touch=True)
    replay(trace, Spy(SimulatedDriver()), check_every=100)
    assert calls == []
    replay(trace, Spy(SimulatedDriver()))
    assert calls == [len(trace.alloc_free_events())]


def test_other_allocators_have_no_compiled_path():
    a = make_allocator("vms")
    assert a.compiled_replay(event_arrays(synthetic_trace("lora", seed=1, steps=1).alloc_free_events())) is None


def _reference(is_alloc, addr, pre_addr):
    """The Python replay's address map, event by event (what match_frees computes at once)."""
    amap = {a: k for k, a in enumerate(pre_addr)}
    pre, freed_at, out, first = set(pre_addr), {}, [], []
    for i, (al, a) in enumerate(zip(is_alloc, addr)):
        first.append(0)
        if al:
            amap[a] = len(pre_addr) + i
            freed_at.pop(a, None)
            out.append(None)
        elif a in amap:
            out.append(amap.pop(a))
            freed_at[a] = i
            if a in pre:
                pre.discard(a)
                first[-1] = 1
        elif a in freed_at:
            out.append(-2 - freed_at[a])
        else:
            out.append(-1)
    return out, first


@pytest.mark.parametrize("seed", range(20))
def test_match_frees_is_the_address_map(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    is_alloc = np.array([rng.random() < 0.5 for _ in range(n)], np.int8)
    addr = np.array([rng.randrange(12) for _ in range(n)], np.int64)  # few addresses: every collision
    pre_addr = np.array(rng.sample(range(16), rng.randrange(5)), np.int64)
    match, first = match_frees(is_alloc, addr, pre_addr)
    want, want_first = _reference(is_alloc.tolist(), addr.tolist(), pre_addr.tolist())
    upto = next((i for i, w in enumerate(want) if w is not None and w <= -2), n)  # the replay stops at a double free
    for i in range(upto + 1 if upto < n else n):
        if not is_alloc[i]:
            assert match[i] == want[i], (i, match[i], want[i])
            assert first[i] == want_first[i], i
