"""The protocol answers what callers used to probe for: path counts, a driver's replay figures,
whether a driver can list its resources."""

import pytest

from vmstoolkit.pools import allocator_names, make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.trace.run import replay_trace
from vmstoolkit.trace.synthetic import synthetic_trace
from vmstoolkit.units import GiB, MiB


@pytest.mark.parametrize("name", allocator_names())
def test_every_allocator_answers_its_path_counts(name):
    a = make_allocator(name)
    a.free(a.allocate(3 * MiB))
    counts, paths = dict(a.counts), a.path_counts()
    assert all(isinstance(v, int) for v in counts.values())
    assert paths.items() >= counts.items()  # path_counts adds to counts, never changes them
    a.close()


def test_allocators_with_one_path_have_no_counts():
    assert make_allocator("native").path_counts() == {} and not make_allocator("pytorch-caching").counts
    assert make_allocator("vms").counts["new"] == 0


def test_a_driver_without_replay_figures_adds_none():
    assert SimulatedDriver().replay_extra() == {}


def test_replay_reports_what_the_driver_and_the_allocators_paths_say(monkeypatch):
    class Reporting(SimulatedDriver):
        def replay_extra(self):
            return {"device_used_at_peak": self.peak_physical_bytes, "device": "reporting"}

    import vmstoolkit.trace.run as run

    monkeypatch.setattr(run, "make_driver", lambda kind, capacity=None: Reporting(capacity=capacity))
    trace = synthetic_trace("lora", 0)
    r = replay_trace(trace, "vms")
    assert r.extra["device"] == "reporting" and r.extra["device_used_at_peak"] == r.peak_reserved
    assert r.extra["paths"]["small"] > 0
    assert "paths" not in replay_trace(trace, "native").extra


class Unlisted(SimulatedDriver):
    """A driver that, like the real one, cannot list its handles, mappings and reservations."""

    lists_resources = False

    def live_handles(self):
        raise NotImplementedError("unlisted")

    live_mappings = live_reservations = live_handles


@pytest.mark.parametrize("name", ["vms", "gmlake", "paged"])
def test_check_asks_the_driver_for_its_resources_only_where_it_can_list_them(name):
    a = make_allocator(name, Unlisted(capacity=GiB))
    p = a.allocate(5 * MiB)
    a._check()  # would call live_handles / live_mappings and fail
    a.free(p)
    a.close()


# -- the protocol at its limits (issue 37, attack items 4 and 5) -------------------------------
@pytest.mark.parametrize("name", allocator_names())
@pytest.mark.parametrize("bad", [1.5, "x", None, b"\x00", [1], 2**70, -1, True])
def test_freeing_what_is_not_an_address_is_the_invalid_free_error(name, bad):
    from vmstoolkit.errors import InvalidFreeError

    a = make_allocator(name)
    keep = a.allocate(3 * MiB)
    for call in (a.free, a.size_of, lambda x: a.record_stream(x, 1)):
        with pytest.raises(InvalidFreeError) as e:
            call(bad)
        text = str(e.value)
        assert (f"{bad:#x}" if type(bad) is int else repr(bad)) in text and "\n" not in text
    a._check()
    assert a.live_allocations() == {keep: 3 * MiB}
    a.close()
    assert a.driver.is_empty()


@pytest.mark.parametrize("name", allocator_names())
def test_a_closed_allocator_refuses_new_work_and_a_second_close_is_harmless(name):
    from vmstoolkit.errors import AllocatorClosedError

    a = make_allocator(name)
    addr = a.allocate(3 * MiB)
    a.close()
    with pytest.raises(AllocatorClosedError, match=f"{name}: .*closed"):
        a.allocate(MiB)
    with pytest.raises(AllocatorClosedError):
        a.free(addr)
    a.close()
    a.empty_cache()
    assert a.driver.is_empty() and a.allocated_bytes == 0


def test_a_closed_paged_allocator_refuses_a_compiled_replay():
    from vmstoolkit.errors import AllocatorClosedError
    from vmstoolkit.trace.replay import event_arrays

    a = make_allocator("paged")
    a.close()
    with pytest.raises(AllocatorClosedError):
        a.compiled_replay(event_arrays(synthetic_trace("lora", 0).alloc_free_events()))


@pytest.mark.parametrize("name", allocator_names())
def test_a_dropped_allocator_is_freed_at_once_not_by_the_cycle_collector(name):
    """Issue 37's attack pass: every allocator sat in a reference cycle (its held-frees helper kept
    its bound ``_free``), so only the cyclic collector freed it, which does not count the arrays
    it holds: the fault-injection tests' loop of paged allocators grew one process by 7.7 GB."""
    import gc
    import weakref

    a = make_allocator(name)
    a.free(a.allocate(3 * MiB))
    a.free(a.allocate(300 * 1024, 1), 2)  # a free held for another stream
    a.close()
    gone = weakref.ref(a)
    was = gc.isenabled()
    gc.disable()
    try:
        del a
        assert gone() is None
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("name", allocator_names())
@pytest.mark.parametrize("bad", ["x", None, 1.5, True, 2**70])
def test_a_stream_that_is_no_handle_is_a_one_line_error_and_changes_nothing(name, bad):
    """The attack pass of issue 37: a stream of "x", None or 1.5 was accepted by four allocators
    (silently), raised TypeError in pytorch-expandable, and broke paged's state (its close then
    failed); 2**70 overflowed paged's arrays."""
    from vmstoolkit.errors import VmsError

    a = make_allocator(name)
    keep = a.allocate(3 * MiB, 7)
    calls = [lambda: a.allocate(MiB, bad), lambda: a.record_stream(keep, bad)]
    if bad is not None:  # free(addr, None): the allocation's own stream
        calls.append(lambda: a.free(keep, bad))
    for call in calls:
        with pytest.raises(VmsError, match="stream") as e:
            call()
        assert "\n" not in str(e.value)
    a._check()
    assert a.live_allocations() == {keep: 3 * MiB}
    a.free(keep, 7)
    a.close()
    assert a.driver.is_empty()
