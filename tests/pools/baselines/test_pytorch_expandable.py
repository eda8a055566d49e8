"""pytorch-expandable: page mapping, splitting, best fit, unmapping on retry and empty_cache,
random sequences against ``_check()``, and fidelity on the real H200 traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import ConfigError, OutOfMemoryError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.baselines.pytorch_expandable import PyTorchExpandableAllocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.trace import bundled_trace_paths, recorded_stats, replay
from vmstoolkit.units import MiB

from tests.pools.programs import replay_at_recorded_addresses, run_random_program


def make(capacity=None, config=None) -> PyTorchExpandableAllocator:
    return PyTorchExpandableAllocator(SimulatedDriver(capacity=capacity), config)


def reserved(a) -> int:
    return a.stats().reserved_bytes


def test_large_requests_map_20mib_pages_at_the_end():
    a = make()
    p = a.allocate(30 * MiB)
    assert reserved(a) == 40 * MiB and a.driver.calls["create"] == 2
    q = a.allocate(15 * MiB)  # 10 MiB free at the end + one more page
    assert q == p + 30 * MiB and reserved(a) == 60 * MiB
    assert len(a.expandable_segments) == 1
    a._check()


def test_small_requests_map_2mib_pages_in_their_own_segment():
    a = make()
    a.allocate(1000)
    a.allocate(3 * MiB)
    assert reserved(a) == 2 * MiB + 20 * MiB
    assert sorted(es.page for es in a.expandable_segments) == [2 * MiB, 20 * MiB]
    a._check()


def test_any_remainder_is_split():
    a = make()
    p = a.allocate(19 * MiB)  # the caching allocator would hand out the whole 20 MiB
    assert a.active[p].size == 19 * MiB
    a.allocate(3 * MiB // 2)
    assert reserved(a) == 40 * MiB  # 19 + 1.5 > 20: one more page, but the 1 MiB is used
    a._check()


def test_free_keeps_pages_mapped_until_empty_cache():
    a = make()
    p = a.allocate(100 * MiB)
    a.free(p)
    assert reserved(a) == 100 * MiB
    a.empty_cache()
    assert reserved(a) == 0 and a.driver.is_empty(), a.driver.leak_report()


def test_empty_cache_unmaps_only_whole_free_pages():
    a = make()
    a.allocate(10 * MiB)
    b = a.allocate(30 * MiB)  # [10, 40): page 0 is shared, page 1 is b's alone
    a.free(b)
    a.empty_cache()
    assert reserved(a) == 20 * MiB
    a._check()


def test_best_fit_passes_over_the_growable_end_block():
    a = make()
    base = a.allocate(20 * MiB)
    b = a.allocate(20 * MiB)
    a.allocate(15 * MiB)  # maps [40, 60): a 5 MiB free block at the end, growable
    a.free(b)  # a 20 MiB free block in the middle
    assert a.allocate(4 * MiB) == base + 20 * MiB  # not at the end, at 55 MiB
    a._check()


def test_unmapped_holes_are_filled_first():
    a = make()
    base = a.allocate(20 * MiB)
    b = a.allocate(20 * MiB)
    a.allocate(20 * MiB)
    a.free(b)
    a.empty_cache()
    assert reserved(a) == 40 * MiB
    assert a.allocate(20 * MiB) == base + 20 * MiB
    assert reserved(a) == 60 * MiB
    a._check()


def test_out_of_memory_unmaps_other_streams_free_pages_and_retries():
    a = make(capacity=100 * MiB)
    a.free(a.allocate(60 * MiB, stream=0))
    a.allocate(60 * MiB, stream=1)  # its own segment; 60 + 60 > 100 until stream 0's pages go
    assert reserved(a) == 60 * MiB and a.num_alloc_retries == 1
    a._check()


def test_out_of_memory_when_nothing_can_be_unmapped():
    a = make(capacity=100 * MiB)
    a.allocate(60 * MiB, stream=0)
    with pytest.raises(OutOfMemoryError):
        a.allocate(60 * MiB, stream=1)
    a._check()
    a.close()
    assert a.driver.is_empty(), a.driver.leak_report()


def test_injected_map_failure_leaves_nothing_mapped():
    d = SimulatedDriver()
    d.fail_on("map", 2)
    a = PyTorchExpandableAllocator(d)
    with pytest.raises(Exception, match="injected"):
        a.allocate(30 * MiB)
    a._check()
    assert reserved(a) == 0 and not d.live_mappings() and not d.live_handles()


def test_configuration():
    a = make_allocator("pytorch-expandable", config="max_split_size_mb:128")
    assert a.config.expandable_segments and a.config.max_split_size == 128 * MiB
    with pytest.raises(ConfigError, match="expandable_segments"):
        make_allocator("pytorch-expandable", config="expandable_segments:False")
    with pytest.raises(ConfigError, match="'nope'"):
        make_allocator("pytorch-expandable", config="nope:1")


SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 50 * MiB))
OPS = st.lists(st.tuples(st.sampled_from("aaf e"), SIZES, st.integers(0, 1), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_random_sequences_keep_invariants(ops):
    run_random_program(make(capacity=160 * MiB), ops)


EXPANDABLE = bundled_trace_paths("expandable")
CACHING = bundled_trace_paths("caching")


@pytest.mark.slow
@pytest.mark.parametrize("path", CACHING, ids=lambda p: p.name.split(".")[0])
def test_fidelity_peak_reserved_within_3_percent(path, bundled_trace):
    """The workload's caching-run trace, replayed with expandable segments, reserves what the
    real expandable run of the same workload reserved (its ``.expandable.json``)."""
    real = recorded_stats(path, "expandable")["peak_reserved"]
    result = replay(bundled_trace(path), make_allocator("pytorch-expandable"))
    assert not result.oom
    assert abs(result.peak_reserved - real) / real < 0.03, (result.peak_reserved, real)


class RecordedBaseDriver(SimulatedDriver):
    """Reserves each segment's virtual range where the real run had it."""

    def __init__(self, bases):
        super().__init__()
        self.bases = list(bases)

    def _reserve(self, size, alignment):
        va = self.bases.pop(0)
        self._reservations[va] = size
        return va


@pytest.mark.slow
@pytest.mark.parametrize("path", EXPANDABLE, ids=lambda p: p.name.split(".")[0])
def test_every_allocation_lands_where_pytorch_put_it(path, bundled_trace):
    trace = bundled_trace(path)
    maps = [e for e in trace.events if e.action.value == "segment_map"]
    ends, bases = set(), []
    for e in maps:  # a map that does not continue an earlier one starts a new segment
        if e.addr not in ends:
            bases.append(e.addr)
        ends.add(e.addr + e.size)
    a = PyTorchExpandableAllocator(RecordedBaseDriver(bases))
    replay_at_recorded_addresses(a, trace)
    assert a.driver.peak_physical_bytes == trace.recorded_peak_reserved()
    a._check()


def test_one_failed_unmap_in_empty_cache_does_not_break_later_allocations():
    """Issue 15 item 6: after one failed unmap in empty_cache, every later allocation on those
    pages failed with "overlaps an existing mapping" until empty_cache ran again."""
    from vmstoolkit.errors import DriverError
    from vmstoolkit.pools import make_allocator
    from vmstoolkit.pools.drivers.sim import SimulatedDriver
    from vmstoolkit.units import GiB, MiB

    d = SimulatedDriver(capacity=4 * GiB)
    a = make_allocator("pytorch-expandable", d)
    x = a.allocate(60 * MiB)
    a.free(x)
    d.fail_on("unmap", d.calls["unmap"] + 1)
    with pytest.raises(DriverError):
        a.empty_cache()
    d.clear_faults()
    y = a.allocate(60 * MiB)  # the same pages again, without another empty_cache
    d.memset(y, 60 * MiB)
    a._check()
    a.free(y)
    a.close()
    assert d.is_empty(), d.leak_report()
