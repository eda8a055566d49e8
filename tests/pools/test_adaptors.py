"""Adaptors wrap any allocator and speak its protocol: limits, statistics, snapshot logging."""

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import ConfigError, DriverError, InvalidFreeError, OutOfMemoryError
from vmstoolkit.integrations.bridge import torch_stats
from vmstoolkit.pools import allocator_names, make_allocator, make_driver
from vmstoolkit.pools.adaptors import (
    AllocatorAdaptor,
    LimitingAdaptor,
    SnapshotLog,
    SnapshotLoggingAdaptor,
    Statistics,
    StatisticsAdaptor,
    unwrap,
)
from vmstoolkit.pools.base import Allocator
from vmstoolkit.trace.loader import load_trace
from vmstoolkit.trace.replay import replay
from vmstoolkit.trace.synthetic import synthetic_trace
from vmstoolkit.units import GiB, MiB


def test_an_adaptor_forwards_every_method_of_the_protocol():
    """An adaptor keeps no bookkeeping of its own: a protocol method it inherited from Allocator
    would read state it does not have. Every one must be its own (forwarding) method."""
    names = {n for n, v in vars(Allocator).items() if callable(v) or isinstance(v, property)}
    names -= {"__init__", "__repr__", "_free_streamed", "_forget", "_empty_cache", "_address",
              "_free_live", "_stream"}  # reached only from the base's own methods
    missing = {n for n in names if n not in vars(AllocatorAdaptor)}
    assert not missing, f"AllocatorAdaptor inherits {sorted(missing)} from Allocator"


def test_an_adaptor_reads_like_its_upstream():
    vms = make_allocator("vms")
    a = StatisticsAdaptor(vms)
    assert a.name == "vms" and a.driver is vms.driver and a.counts is vms.counts
    p = a.allocate(3 * MiB)
    assert a.size_of(p) == 3 * MiB and a.live_allocations() == {p: 3 * MiB} and a.allocated_bytes == 3 * MiB
    assert a.stats().allocated_bytes == vms.stats().allocated_bytes == 3 * MiB
    assert a.compiled_replay(None) is None and a.compiled_hook is None
    a.close()
    assert vms.driver.physical_bytes == 0


# -- limits ---------------------------------------------------------------------------------------
def test_a_limit_refuses_with_the_figures_and_frees_make_room():
    a = LimitingAdaptor(make_allocator("vms"), "10MiB")
    p = a.allocate(6 * MiB)
    with pytest.raises(OutOfMemoryError) as e:
        a.allocate(5 * MiB)
    err = e.value
    assert err.requested == 5 * MiB and err.limit == 10 * MiB and err.reserved == a.driver.physical_bytes
    assert "5242880" in str(err) and "10485760" in str(err) and "6291456" in str(err)
    assert a.stats().num_ooms == 1 and a.upstream.stats().num_ooms == 0  # refused before the upstream saw it
    a.free(p)
    q = a.allocate(10 * MiB)
    assert a.allocated_through == 10 * MiB
    a._check()
    a.free(q)
    assert a.allocated_through == 0


def test_a_limit_must_be_a_positive_size():
    for bad in (0, "0MiB", "lots"):
        with pytest.raises(ConfigError if bad != "lots" else ValueError):
            LimitingAdaptor(make_allocator("native"), bad)


def test_a_bad_free_through_a_limit_changes_nothing():
    a = LimitingAdaptor(make_allocator("native"), GiB)
    p = a.allocate(100)
    with pytest.raises(InvalidFreeError):
        a.free(p + 1)
    assert a.allocated_through == 100


# -- statistics -----------------------------------------------------------------------------------
def test_statistics_per_size_class_and_stream():
    a = StatisticsAdaptor(make_allocator("vms"))
    small = a.allocate(512, 1)
    large = a.allocate(4 * MiB, 2)
    a.free(large, 2)
    other = a.allocate(2 * MiB, 1)
    s = a.statistics()
    assert (s.current_bytes, s.current_count, s.peak_bytes, s.total_count) == (512 + 2 * MiB, 2, 512 + 4 * MiB, 3)
    pools = a.pool_statistics()
    assert pools["small_pool"].current_bytes == 512 and pools["large_pool"].peak_bytes == 4 * MiB
    streams = a.stream_statistics()
    assert streams[1].current_bytes == 512 + 2 * MiB and streams[2].current_bytes == 0 and streams[2].peak_bytes == 4 * MiB
    a._check()
    a.free(small)
    a.free(other)


def test_nested_counters_add_up_as_rmms_do():
    a = StatisticsAdaptor(make_allocator("native"))
    p = a.allocate(1000)
    with a.counting() as scope:
        q = a.allocate(300)
        a.free(q)
        r = a.allocate(200)
        assert a.statistics().peak_bytes == 300  # the scope's own counters
    assert (scope.total_bytes, scope.peak_bytes, scope.current_bytes) == (500, 300, 200)
    outer = a.statistics()
    assert (outer.current_bytes, outer.peak_bytes, outer.total_count) == (1200, 1300, 3)
    a.free(p)
    a.free(r)
    with pytest.raises(ConfigError):
        a.pop_counters()


def test_the_merge_of_a_scope_keeps_its_peak_on_top_of_what_was_current():
    outer = Statistics(current_bytes=10, current_count=1, peak_bytes=50, peak_count=2, total_bytes=60, total_count=3)
    inner = Statistics(current_bytes=-5, current_count=-1, peak_bytes=45, peak_count=2, total_bytes=45, total_count=2)
    m = outer.merged(inner)
    assert (m.current_bytes, m.peak_bytes, m.peak_count, m.total_bytes) == (5, 55, 3, 105)


def test_pytorch_reads_the_size_classes_from_the_statistics():
    a = StatisticsAdaptor(make_allocator("vms"))
    a.allocate(100)
    p = a.allocate(3 * MiB)
    a.free(p)
    t = torch_stats(a.stats())
    assert t["allocated_bytes.small_pool.current"] == 100 and t["allocation.small_pool.current"] == 1
    assert t["allocated_bytes.large_pool.peak"] == 3 * MiB and t["allocated_bytes.large_pool.freed"] == 3 * MiB
    assert t["allocated_bytes.all.current"] == 100
    a.reset_peak_stats()
    assert torch_stats(a.stats())["allocated_bytes.large_pool.peak"] == 0


def test_frees_of_allocations_made_before_wrapping_are_not_counted():
    vms = make_allocator("vms")
    early = vms.allocate(2 * MiB)
    a = StatisticsAdaptor(vms)
    a.free(early)
    assert a.statistics().current_bytes == 0
    a._check()


# -- snapshot logging -----------------------------------------------------------------------------
def test_a_logged_run_loads_and_replays_to_the_same_figures(tmp_path):
    trace = synthetic_trace("lora", 0)
    logged = SnapshotLoggingAdaptor(make_allocator("vms"))
    direct = replay(trace, make_allocator("vms"))
    through = replay(trace, logged)
    assert (through.peak_allocated, through.peak_reserved) == (direct.peak_allocated, direct.peak_reserved)
    path = logged.dump_snapshot(tmp_path / "run.pickle.gz")
    back = load_trace(path)
    assert back.allocator_settings == {"vmstoolkit": "vms"}
    assert [(e.action, e.size, e.stream) for e in back.alloc_free_events()] == \
        [(e.action, e.size, e.stream) for e in trace.alloc_free_events()]
    again = replay(back, make_allocator("vms"))
    assert (again.peak_allocated, again.peak_reserved) == (direct.peak_allocated, direct.peak_reserved)


def test_a_free_is_logged_on_the_allocations_stream_and_an_oom_is_logged():
    log = SnapshotLog(max_entries=10)
    a = SnapshotLoggingAdaptor(make_allocator("vms", capacity=64 * MiB), log, device=1)
    p = a.allocate(3 * MiB, 7)
    a.free(p)  # no stream given: the allocation's
    with pytest.raises(OutOfMemoryError):
        a.allocate(GiB, 7)
    events = log.snapshot()["device_traces"][1]
    assert [(e["action"], e["stream"]) for e in events] == [("alloc", 7), ("free_completed", 7), ("oom", 7)]
    assert events[2]["size"] == GiB and events[2]["device_free"] == events[2]["addr"]
    assert log.snapshot()["device_traces"][0] == []


def test_the_adaptors_snapshot_has_a_segment_per_live_allocation(tmp_path):
    """``snapshot()`` / ``dump_snapshot()`` of the adaptor itself (not only through the PyTorch
    handle) list the live allocations as PyTorch's segments, with their stream and device."""
    a = SnapshotLoggingAdaptor(make_allocator("vms", capacity=64 * MiB), device=1)
    p, q = a.allocate(3 * MiB, 7), a.allocate(MiB, 0)
    a.free(q)
    segs = a.snapshot()["segments"]
    assert [(s["address"], s["total_size"], s["stream"], s["device"]) for s in segs] == [(p, 3 * MiB, 7, 1)]
    assert load_trace(a.dump_snapshot(tmp_path / "s.pickle")).events


def test_the_log_keeps_the_first_entries():
    log = SnapshotLog(max_entries=2)
    a = SnapshotLoggingAdaptor(make_allocator("native"), log)
    for _ in range(3):
        a.free(a.allocate(10))
    assert [e["action"] for e in log.device_traces[0]] == ["alloc", "free_completed"] and log.dropped == 4


# -- composition ------------------------------------------------------------------------------------
def test_unwrap_takes_one_adaptor_out_of_a_chain():
    base = make_allocator("native")
    s = StatisticsAdaptor(base)
    lim = LimitingAdaptor(s, GiB)
    assert unwrap(lim, s) is lim and lim.upstream is base
    assert unwrap(lim, lim) is base
    with pytest.raises(ConfigError):
        unwrap(base, s)


def test_a_free_that_fails_in_the_driver_is_gone_for_every_adaptor_too():
    d = make_driver("sim")
    logged = SnapshotLoggingAdaptor(make_allocator("native", d))
    a = LimitingAdaptor(StatisticsAdaptor(logged), GiB)
    p = a.allocate(3 * MiB)
    d.fail_on("unmap", d.calls["unmap"] + 1)
    with pytest.raises(DriverError):
        a.free(p)
    assert a.allocated_through == 0 and a.upstream.statistics().current_bytes == 0 and a.allocated_bytes == 0
    assert [e["action"] for e in logged.log.device_traces[0]] == ["alloc", "free_completed"]
    a._check()
    a.close()


@pytest.mark.parametrize("name", allocator_names())
def test_every_allocator_through_a_chain_of_adaptors_replays_as_bare(name):
    trace = synthetic_trace("lora", 1)
    bare = replay(trace, make_allocator(name))
    chain = LimitingAdaptor(StatisticsAdaptor(SnapshotLoggingAdaptor(make_allocator(name))), 141 * GiB)
    wrapped = replay(trace, chain, check_every=500)
    assert (wrapped.peak_allocated, wrapped.peak_reserved, wrapped.driver_calls) == \
        (bare.peak_allocated, bare.peak_reserved, bare.driver_calls)
    assert chain.upstream.statistics().peak_bytes == bare.peak_allocated  # the statistics saw every event
    chain.close()
    assert chain.driver.physical_bytes == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6 * MiB), st.integers(0, 2)), min_size=1, max_size=40),
       st.sampled_from(["vms", "paged", "pytorch-caching"]))
def test_random_operations_on_several_streams_keep_every_invariant(ops, name):
    a = LimitingAdaptor(StatisticsAdaptor(SnapshotLoggingAdaptor(make_allocator(name, make_driver("sim", capacity=64 * MiB)))),
                        "32MiB")
    live = []
    for op, size, stream in ops:
        if op and live:
            a.free(*live.pop(size % len(live)))
        else:
            try:
                live.append((a.allocate(size, stream), stream))
            except OutOfMemoryError:
                pass
        a._check()
    assert a.allocated_through == sum(a.size_of(p) for p, _ in live)
    a.close()
