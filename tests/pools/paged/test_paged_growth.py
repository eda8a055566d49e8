"""``paged``'s ``grow_pages``: new physical memory made several pages per ``cuMemCreate`` (issue
34, item 7: fewer driver calls on the steps whose peak grows), with the same pages mapped, the
same placement and the same physical memory as the default."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pools.programs import run_random_program
from vmstoolkit.errors import ConfigError, DriverError, OutOfMemoryError
from vmstoolkit.integrations.hook_allocator import HookAllocator
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.registry import check_allocator as check_options
from vmstoolkit.units import GiB, MiB

G = 2 * MiB
CALLS = ("create", "map", "set_access")
SHAPES = (3 * MiB, 40 * MiB, 7 * MiB, 100 * MiB, 18 * MiB)  # one step's requests at scale 1


def _steps(a, driver, scales):
    """One step per scale: allocate every shape times the scale (the peak grows with it), free
    them all; per step the driver calls of :data:`CALLS`."""
    out = []
    for scale in scales:
        before = {k: driver.calls[k] for k in CALLS}
        ps = [a.allocate(s * scale) for s in SHAPES]
        for p in ps:
            a.free(p)
        out.append({k: driver.calls[k] - before[k] for k in CALLS})
    return out


SCALES = (1, 2, 3, 5, 8)  # the growing program's steps: each shape times these


def _beside_expandable(hook: bool, base: dict, changed: dict, scales=SCALES):
    """(per-step calls, peak) of ``paged`` with ``base`` and with ``changed`` options (through the
    compiled hook if ``hook``), and expandable segments' per-step calls, on the same growing program."""
    runs = []
    for opt in (base, changed):
        d = SimulatedDriver(capacity=16 * GiB)
        a = HookAllocator("paged", d, **opt) if hook else make_allocator("paged", d, **opt)
        runs.append((_steps(a, d, scales), a.stats().peak_reserved_bytes))
        a.close()
    d = SimulatedDriver(capacity=16 * GiB)
    x = make_allocator("pytorch-expandable", d)
    expandable = _steps(x, d, scales)
    x.close()
    return runs[0], runs[1], expandable


@pytest.mark.parametrize("hook", [False, True], ids=["python", "hook"])
@pytest.mark.parametrize("n", [4, 10])
def test_a_growing_peak_makes_n_pages_per_create_and_fewer_calls_than_the_default(hook, n):
    """Each step's peak grows: the default makes one create per new page; ``grow_pages=n`` makes
    at most one per n new pages per block, maps the same pages (as many maps) and so cuts the
    calls; creates are within one per block of expandable segments' (which grow 20 MiB, 10
    pages, at a time), where the default's are about 10 times theirs. Through the compiled
    hook too (the real-GPU path's slow path, here on the simulated driver)."""
    (default, peak0), (grow, peak), expandable = _beside_expandable(hook, {}, {"grow_pages": n})
    assert peak == peak0
    for s0, s, e in zip(default, grow, expandable):
        assert s["map"] == s0["map"] and s["set_access"] == s0["set_access"]  # the same pages mapped
        assert s0["create"] >= 9 * e["create"] - 9 * len(SHAPES)  # the default: a create per page
        assert s["create"] <= -(-s0["create"] // n) + len(SHAPES)
        if n == 10:
            assert s["create"] <= e["create"] + len(SHAPES)
    assert sum(s0["create"] for s0 in default) > 0
    # a map and a create per page before; a map and 1/n create (plus one per block) now
    total, total0 = (sum(sum(s.values()) for s in r) for r in (grow, default))
    assert total <= (0.5 + 0.5 / n) * total0 + len(SHAPES) * len(SCALES)


def _live_physical(a) -> list:
    """The physical bytes (handle, offset) the driver maps at every page a live block uses."""
    out = []
    for h in (a.large, a.small):
        for p in (h.page_used > 0).nonzero()[0].tolist():
            (piece,) = a.driver._physical(h.base + (p << a.page_shift), a.page)
            out.append(piece[:2])
    return out


ops = st.lists(st.tuples(st.sampled_from("aaf"), st.one_of(st.integers(1, MiB), st.integers(MiB + 1, 13 * G)),
                         st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops, n=st.sampled_from([2, 3, 10]), aliases=st.booleans(), slack=st.sampled_from([0, 5]))
def test_random_programs_place_and_hold_exactly_as_the_default(program, n, aliases, slack):
    """Side by side with the default on a random program: every address, every page's mapping
    and the physical bytes are the same after each step (only the creates differ), and every
    invariant holds (``_check``: chunks held == the driver's physical bytes, the driver's
    mappings == the books)."""
    cap = 40 * G
    a0 = make_allocator("paged", SimulatedDriver(capacity=cap), aliases=aliases, slack_pages=slack, max_blocks=256)
    a = make_allocator("paged", SimulatedDriver(capacity=cap), aliases=aliases, slack_pages=slack, grow_pages=n,
                       max_blocks=256)
    live = []
    for kind, size, pick in program:
        if kind == "a" or not live:
            try:
                p0 = a0.allocate(size)
            except OutOfMemoryError:
                with pytest.raises(OutOfMemoryError):
                    a.allocate(size)
            else:
                assert a.allocate(size) == p0
                a.driver.memset(p0, size)
                live.append(p0)
        else:
            p = live.pop(pick % len(live))
            a0.free(p)
            a.free(p)
        a._check()
        assert a.driver.physical_bytes == a0.driver.physical_bytes
        assert a.driver.calls["map"] == a0.driver.calls["map"]
        assert a.driver.calls["create"] <= a0.driver.calls["create"]
        phys = _live_physical(a)
        assert len(set(phys)) == len(phys), "two live pages map the same physical page"
        for h0, h in ((a0.large, a.large), (a0.small, a.small)):
            assert ((h.page_chunk >= 0) == (h0.page_chunk >= 0)).all()
    for x in (a0, a):
        x.close()
        assert x.driver.is_empty(), x.driver.leak_report()


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(st.tuples(st.sampled_from("aafe"), st.integers(1, 9 * G), st.integers(0, 10**6)),
                        min_size=1, max_size=50), n=st.sampled_from([2, 10]))
def test_empty_cache_releases_whole_handles_only(program, n):
    """``empty_cache`` releases a handle once none of its pages is mapped; the pages of a handle
    partly in use stay held (free, on the stack), at most ``n - 1`` per handle a live block
    uses. Invariants hold after every step and closing leaks nothing."""
    cap = 40 * G
    a = make_allocator("paged", SimulatedDriver(capacity=cap), grow_pages=n, max_blocks=256)

    def whole_handles_only(a):
        used = {a.handles[int(c)] for h in (a.large, a.small) for c in h.page_chunk[h.page_used > 0]}
        assert {h for h in a.handles if h is not None} == used  # every handle no live page uses is gone
        assert a.driver.physical_bytes <= (int(a.g[H.G_LIVE_PAGES]) + (n - 1) * len(used)) * G

    run_random_program(a, [(kind, size, 0, pick) for kind, size, pick in program], whole_handles_only)


def _fail_each_call(op: str, program, **options) -> None:
    """Run ``program`` on ``paged`` with ``options`` once per ``op`` call it makes, that call failing:
    a clear error or none, every invariant holds, closing gives the driver everything back."""
    d0 = SimulatedDriver(capacity=64 * G)
    a0 = make_allocator("paged", d0, **options)
    program(a0)
    reached = d0.calls[op]
    a0.close()
    assert reached > 0
    for k in range(1, reached + 1):
        d = SimulatedDriver(capacity=64 * G)
        d.fail_on(op, k)
        a = make_allocator("paged", d, **options)
        try:
            program(a)
        except (DriverError, OutOfMemoryError) as e:
            assert "injected fault" in str(e), e
        a._check()
        d.clear_faults()
        a.close()
        assert d.is_empty(), (op, k, d.leak_report())


@pytest.mark.parametrize("op", ["create", "map", "set_access"])
def test_a_fault_on_any_call_while_growing_leaves_a_whole_state(op):
    """Each ``op`` call of a growing program fails once in turn: a clear error (or, for a create
    within the peak, none: a smaller create makes up for it), every invariant holds, nothing leaks."""
    def program(a):
        ps = [a.allocate(s) for s in (5 * G, 300, 11 * G)]
        a.free(ps[0])
        ps.append(a.allocate(17 * G))
        for p in ps[1:]:
            a.free(p)

    _fail_each_call(op, program, grow_pages=4)


def test_a_create_refused_for_lack_of_memory_falls_back_to_single_pages():
    """Near the device's end a create of ``n`` pages fails where single pages still fit: the
    request is served, as by the default, from single-page creates."""
    cap = 10 * G
    a0 = make_allocator("paged", SimulatedDriver(capacity=cap))
    a = make_allocator("paged", SimulatedDriver(capacity=cap), grow_pages=4)
    for x in (a0, a):
        p = x.allocate(7 * G)
        q = x.allocate(3 * G)  # 3 more pages: one create of 4 cannot fit
        assert x.driver.physical_bytes == cap
        x._check()
        for y in (p, q):
            x.free(y)
    assert a.driver.calls["create"] < a0.driver.calls["create"]
    a.close()
    a0.close()


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "abc"])
def test_bad_grow_pages_is_one_line_naming_the_value(value):
    with pytest.raises(ConfigError) as e:
        check_options("paged", {"grow_pages": value})
    msg = str(e.value)
    assert "grow_pages" in msg and repr(value) in msg and "\n" not in msg


def test_grow_pages_parses_from_a_mode_spec():
    assert check_options("paged", {"grow_pages": "10"})["grow_pages"] == 10


@pytest.mark.parametrize("aliases", [False, True])
def test_a_replay_under_grow_pages_is_the_defaults_but_for_the_creates(aliases):
    """The compiled replay (which leaves ``grow_pages`` and ``map_runs`` to the Python path) and
    the Python replay agree; under ``grow_pages`` both give the default's result (peaks, every
    figure) but for fewer creates; ``map_runs`` maps less, within 2% of the default's peak."""
    from vmstoolkit.trace import replay
    from vmstoolkit.trace.synthetic import synthetic_trace

    trace = synthetic_trace("seqgrow", seed=3, steps=3)
    out = []
    runs = {"grow_pages": 8, "map_runs": True}
    for opt, compiled in (({}, True), ({"grow_pages": 8}, True), ({"grow_pages": 8}, False), (runs, True), (runs, False)):
        a = make_allocator("paged", SimulatedDriver(capacity=40 * GiB), aliases=aliases, **opt)
        r = replay(trace, a, compiled=compiled).as_dict()
        a._check()
        for k in ("seconds", "events_per_second"):
            r.pop(k)
        out.append((r, dict(a.driver.calls)))
        a.close()
        assert a.driver.is_empty(), a.driver.leak_report()
    (r0, c0), (r1, c1), (r2, c2), (r3, c3), (r4, c4) = out
    assert r1 == r2 and c1 == c2 and r3 == r4 and c3 == c4
    assert c3["map"] < c1["map"] and r3["peak_reserved"] <= 1.02 * r0["peak_reserved"]
    assert c0["create"] > 0 and c1["create"] <= -(-c0["create"] // 8) + c0["map"] // 2
    assert c1["create"] < c0["create"]
    assert {k: v for k, v in c1.items() if k != "create"} == {k: v for k, v in c0.items() if k != "create"}
    diff = {k for k in r0 if r0[k] != r1[k]}
    assert diff <= {"extra", "driver_calls"}, diff


# -- map_runs: a run of new pages from one handle mapped in one cuMemMap ----------------------------

RUNS = {"aliases": True, "map_runs": True}


@pytest.mark.parametrize("hook", [False, True], ids=["python", "hook"])
def test_map_runs_maps_a_handle_in_one_call_as_expandable_segments_do(hook):
    """With ``map_runs`` the pages a handle backs are one mapping: on a growing peak maps drop
    as creates do, to within one per block of expandable segments' (one create and one map per
    20 MiB), at the default's peak here (every step's peak is new: nothing to lend)."""
    (default, peak0), (grow, peak), expandable = _beside_expandable(hook, {"aliases": True}, {**RUNS, "grow_pages": 10})
    assert peak == peak0
    for s0, s, e in zip(default, grow, expandable):
        assert s0["map"] >= 9 * e["map"] - 9 * len(SHAPES)
        assert s["map"] <= -(-s0["map"] // 10) + len(SHAPES) and s["map"] <= e["map"] + len(SHAPES)
        assert s["create"] <= e["create"] + len(SHAPES) and s["set_access"] <= s0["set_access"]
    assert sum(s["map"] for s in grow) * 5 < sum(s0["map"] for s0 in default)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(st.tuples(st.sampled_from("aaafe"), st.one_of(st.integers(1, MiB), st.integers(MiB + 1, 13 * G)),
                                  st.integers(0, 10**6)), min_size=1, max_size=60),
       n=st.sampled_from([2, 3, 10]), slack=st.sampled_from([0, 5]), aliases=st.booleans(),
       reclaim=st.sampled_from(["top-down", "clock"]), batch=st.sampled_from([1, 4]))
def test_map_runs_random_programs_keep_every_invariant(program, n, slack, aliases, reclaim, batch):
    """Random programs with ``empty_cache``: ``_check`` after each step (the driver's mappings
    are the books' runs and single pages), no two live pages share physical memory, a live page
    never changes its physical memory, every byte of a live block is mapped and accessible, and
    closing gives everything back."""
    a = make_allocator("paged", SimulatedDriver(capacity=40 * G), slack_pages=slack, grow_pages=n, max_blocks=256,
                       map_runs=True, aliases=aliases, reclaim=reclaim, reclaim_batch=batch)
    live, held = [], {}
    for kind, size, pick in program:
        if kind == "e":
            a.empty_cache()
        elif kind == "a" or not live:
            try:
                p = a.allocate(size)
            except OutOfMemoryError:
                pass
            else:
                a.driver.memset(p, size)
                live.append(p)
        else:
            a.free(live.pop(pick % len(live)))
        a._check()
        now = {}
        for h in (a.large, a.small):
            for p in (h.page_used > 0).nonzero()[0].tolist():
                (piece,) = a.driver._physical(h.base + (p << a.page_shift), a.page)
                now[(h.base, p)] = piece[:2]
        assert len(set(now.values())) == len(now), "two live pages map the same physical page"
        assert all(now[k] == v for k, v in held.items() if k in now), "a live page changed its physical memory"
        held = now
    a.close()
    assert a.driver.is_empty(), a.driver.leak_report()


@pytest.mark.parametrize("aliases", [True, False])
@pytest.mark.parametrize("op", ["create", "map", "set_access", "unmap"])
def test_map_runs_a_fault_on_any_call_leaves_a_whole_state(op, aliases):
    """Each ``op`` call of a program that grows, lends and empties the cache fails once in turn
    (a failed map or set_access unmaps whole runs; without aliases, reclaims unmap whole idle
    mappings): the error is clear, every invariant holds, nothing leaks."""
    def program(a):
        ps = [a.allocate(s) for s in (5 * G, 300, 11 * G)]
        a.free(ps[0])
        ps.append(a.allocate(17 * G))
        a.free(ps.pop(1))
        a.empty_cache()
        ps.append(a.allocate(3 * G))
        for p in ps[1:]:
            a.free(p)
        a.empty_cache()

    _fail_each_call(op, program, grow_pages=4, map_runs=True, aliases=aliases)


def test_map_runs_with_one_page_per_handle_is_the_default():
    """``grow_pages=1``: every handle is one page, so every run is one page: the default's calls."""
    runs = []
    for opt in ({}, {"map_runs": True}):
        d = SimulatedDriver(capacity=16 * GiB)
        a = make_allocator("paged", d, aliases=True, **opt)
        runs.append((_steps(a, d, (1, 3, 2, 5)), a.stats().peak_reserved_bytes))
        a.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("first", ["map", "set_access"])
def test_map_runs_a_failed_rollback_unmap_leaves_the_run_stuck_until_repaired(first):
    """A failed map or set_access, then the rollback's unmap of a whole run failing too: the run
    stays in the books, mapped, as the driver has it; the next slow-path call unmaps it whole."""
    d = SimulatedDriver(capacity=4 * GiB)
    a = make_allocator("paged", d, grow_pages=4, **RUNS)
    keep = a.allocate(8 * MiB)
    a.free(a.allocate(1 * MiB))
    # 12 new pages: the idle small page's chunk lent (mapped alone), then handles of 3, 4 and 4
    # pages, one run each; fail the last map (or the access), then the rollback's second unmap (the run of 3)
    d.fail_on(first, d.calls[first] + (4 if first == "map" else 1))
    d.fail_on("unmap", d.calls["unmap"] + 2)
    with pytest.raises(DriverError):
        a.allocate(24 * MiB)
    assert len(a._stuck) == 1 and int(a.large.map_len[a._stuck[0][1]]) == 3, "the run whose unmap failed is stuck whole"
    a._check()  # the books match the driver's mappings
    d.clear_faults()
    xs = [a.allocate(s) for s in (24 * MiB, 2 * MiB, 40 * MiB)]
    assert not a._stuck
    for x, s in zip(xs, (24 * MiB, 2 * MiB, 40 * MiB)):
        d.memset(x, s)
    a._check()
    for x in xs + [keep]:
        a.free(x)
    a.close()
    assert d.is_empty(), d.leak_report()


@pytest.mark.parametrize("aliases", [True, False])
def test_on_a_real_trace_grow_pages_costs_no_memory_and_map_runs_at_most_a_tenth(traces_dir, aliases):
    """``llama-lora`` (the bundled trace where never lending a run's chunks costs most): under
    ``grow_pages=10`` the default's peak and calls exactly but for 5x fewer creates; with
    ``map_runs`` too, at most 10% above its peak (8% with aliases when measured, 1% without)
    with at least 2x fewer calls and maps."""
    from vmstoolkit.trace import load_trace, replay

    trace = load_trace(traces_dir / "llama-lora.caching.pickle.gz")
    out = []
    for opt in ({}, {"grow_pages": 10}, {"grow_pages": 10, "map_runs": True}):
        d = SimulatedDriver(capacity=80 * GiB)
        a = make_allocator("paged", d, aliases=aliases, slack_pages=64 if aliases else 0, **opt)
        r = replay(trace, a, compiled=True)
        assert not r.oom
        out.append((r.peak_reserved, {k: d.calls[k] for k in ("create", "map", "set_access", "unmap", "release")}))
        a.close()
    (peak0, calls0), (peak1, calls1), (peak2, calls2) = out
    assert peak1 == peak0 and calls1["create"] * 5 < calls0["create"]
    assert {k: v for k, v in calls1.items() if k != "create"} == {k: v for k, v in calls0.items() if k != "create"}
    assert peak2 <= 1.10 * peak0 and sum(calls2.values()) * 2 < sum(calls0.values())
    assert calls2["map"] * 2 < calls0["map"]
