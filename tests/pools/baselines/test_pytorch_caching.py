"""pytorch-caching: the rules of PyTorch's caching allocator, pinned on small hand-made
sequences, random sequences against ``_check()``, and fidelity on the real H200 traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import ConfigError, OutOfMemoryError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.baselines.pytorch_caching import PyTorchCachingAllocator, allocation_size, round_size
from vmstoolkit.pools.baselines.pytorch_config import parse_alloc_conf
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.trace import bundled_trace_paths, replay
from vmstoolkit.units import MiB

from tests.pools.programs import replay_at_recorded_addresses, run_random_program


def make(capacity=None, config=None) -> PyTorchCachingAllocator:
    return PyTorchCachingAllocator(SimulatedDriver(capacity=capacity), config)


def block_size(a: PyTorchCachingAllocator, ptr: int) -> int:
    return a.active[ptr].size


# -- sizes -------------------------------------------------------------------------------------
def test_round_size_512_bytes():
    assert [round_size(s) for s in (1, 511, 512, 513, 1536, 1537)] == [512, 512, 512, 1024, 1536, 2048]


def test_round_size_power2_divisions():
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, cfg) == 1536  # not above 512 * 4: plain rounding
    assert round_size(5000, cfg) == 5120  # 4096 .. 8192 in steps of 1024
    assert round_size(5 * MiB + 1, cfg) == 6 * MiB  # 4 MiB .. 8 MiB in steps of 1 MiB
    assert round_size(8 * MiB, cfg) == 8 * MiB  # powers of two stay


def test_allocation_size_segments():
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(21 * MiB) == 22 * MiB


# -- pools, segments, splitting ---------------------------------------------------------------
def test_small_requests_share_a_2mib_segment():
    a = make()
    ptrs = [a.allocate(512 * 1024) for _ in range(4)]
    assert a.stats().reserved_bytes == 2 * MiB
    assert ptrs == [ptrs[0] + i * 512 * 1024 for i in range(4)]
    a.allocate(1)
    assert a.stats().reserved_bytes == 4 * MiB
    a._check()


def test_requests_under_10mib_split_a_20mib_segment():
    a = make()
    p = a.allocate(3 * MiB)
    q = a.allocate(5 * MiB)
    r = a.allocate(12 * MiB)  # exactly the rest: no split
    assert (q - p, r - q) == (3 * MiB, 5 * MiB)
    assert a.stats().reserved_bytes == 20 * MiB
    assert block_size(a, r) == 12 * MiB
    a._check()


def test_large_remainder_of_1mib_is_not_split():
    a = make()
    p = a.allocate(19 * MiB)  # 20 MiB segment, 1 MiB left: not more than kSmallSize
    assert block_size(a, p) == 20 * MiB
    a.allocate(3 * MiB // 2)
    assert a.stats().reserved_bytes == 40 * MiB
    a._check()


def test_large_remainder_over_1mib_is_split():
    a = make()
    p = a.allocate(18 * MiB + 1)  # rounds to 18 MiB + 512: 2 MiB - 512 left, more than 1 MiB
    assert block_size(a, p) == 18 * MiB + 512
    q = a.allocate(3 * MiB // 2)
    assert q == p + 18 * MiB + 512
    assert a.stats().reserved_bytes == 20 * MiB
    a._check()


def test_best_fit_smallest_block_then_lowest_address():
    a = make()
    big = a.allocate(100 * MiB)
    mid1 = a.allocate(40 * MiB)
    mid2 = a.allocate(40 * MiB)
    for p in (big, mid2, mid1):
        a.free(p)
    # 30 MiB fits all three; the 40 MiB ones are smaller, and of those the lowest address wins
    assert a.allocate(30 * MiB) == min(mid1, mid2)
    a._check()


def test_freed_neighbours_merge():
    a = make()
    p = a.allocate(3 * MiB)
    q = a.allocate(3 * MiB)
    a.allocate(3 * MiB)
    a.free(q)
    a.free(p)
    assert a.allocate(6 * MiB) == p  # the two freed blocks became one
    assert a.stats().reserved_bytes == 20 * MiB
    a._check()


def test_cached_segment_is_reused_not_freed():
    a = make()
    p = a.allocate(100 * MiB)
    a.free(p)
    assert a.stats().reserved_bytes == 100 * MiB
    assert a.allocate(100 * MiB) == p
    assert a.driver.calls["mem_alloc"] == 1 and a.driver.calls["mem_free"] == 0


def test_streams_do_not_share_cached_blocks():
    a = make()
    p = a.allocate(100 * MiB, stream=1)
    a.free(p)
    q = a.allocate(50 * MiB, stream=0)
    assert q != p and a.stats().reserved_bytes == 150 * MiB
    a._check()


# -- max_split_size ---------------------------------------------------------------------------
def test_oversize_blocks_are_not_split_for_small_requests():
    a = make(config="max_split_size_mb:64")
    p = a.allocate(100 * MiB)
    a.free(p)
    q = a.allocate(30 * MiB)  # smaller than max_split_size: may not use the 100 MiB block
    assert q != p and a.stats().reserved_bytes == 130 * MiB
    a.free(q)
    r = a.allocate(90 * MiB)  # oversize, within 20 MiB of the block: served whole
    assert r == p and block_size(a, r) == 100 * MiB
    a.free(r)
    s = a.allocate(70 * MiB)  # 100 >= 70 + 20: too wasteful, new segment
    assert s not in (p, q) and a.stats().reserved_bytes == 200 * MiB
    a._check()


def test_max_non_split_rounding():
    a = make(config="max_split_size_mb:64,max_non_split_rounding_mb:40")
    p = a.allocate(100 * MiB)
    a.free(p)
    assert a.allocate(70 * MiB) == p  # 100 < 70 + 40
    a._check()


# -- out of memory: free cached segments and retry, then OOM ----------------------------------
def test_retry_after_freeing_cached_segments():
    a = make(capacity=100 * MiB)
    p = a.allocate(60 * MiB)
    a.free(p)
    q = a.allocate(70 * MiB)  # 60 + 70 > 100: cudaMalloc fails, cache freed, retried
    assert a.stats().reserved_bytes == 70 * MiB
    assert a.num_alloc_retries == 1 and a.driver.calls["mem_free"] == 1
    assert a.size_of(q) == 70 * MiB
    a._check()


def test_release_available_frees_just_enough_oversize_blocks():
    a = make(capacity=200 * MiB, config="max_split_size_mb:64")
    p = a.allocate(100 * MiB)
    q = a.allocate(70 * MiB)
    a.free(p)
    a.free(q)
    a.allocate(40 * MiB)  # 170 + 40 > 200: free the smallest oversize block (70) and retry
    assert a.stats().reserved_bytes == 140 * MiB
    assert a.num_alloc_retries == 0 and a.driver.calls["mem_free"] == 1
    a._check()


def test_out_of_memory_when_nothing_can_be_freed():
    a = make(capacity=100 * MiB)
    a.allocate(60 * MiB)
    with pytest.raises(OutOfMemoryError, match="out of memory") as e:
        a.allocate(70 * MiB)
    assert e.value.requested == 70 * MiB
    assert a.stats().num_ooms == 1 and a.stats().reserved_bytes == 60 * MiB
    a._check()


def test_injected_cudamalloc_failure_is_retried():
    d = SimulatedDriver()
    d.fail_on("mem_alloc", 1)
    a = PyTorchCachingAllocator(d)
    a.allocate(MiB)
    assert a.num_alloc_retries == 1 and a.stats().reserved_bytes == 2 * MiB


def test_garbage_collection_frees_old_blocks_first():
    a = make(capacity=400 * MiB, config="per_process_memory_fraction:0.5,garbage_collection_threshold:0.5")
    a.free(a.allocate(60 * MiB))
    a.free(a.allocate(70 * MiB))
    a.allocate(80 * MiB)  # 130 cached > 100 threshold: the older 60 MiB block goes
    assert a.stats().reserved_bytes == 150 * MiB
    a._check()


def test_memory_fraction_caps_reserved():
    a = make(capacity=400 * MiB, config="per_process_memory_fraction:0.25")
    a.allocate(60 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.allocate(50 * MiB)


def test_close_gives_everything_back():
    a = make()
    for s in (100, 3 * MiB, 30 * MiB, 512):
        a.allocate(s)
    a.close()
    assert a.driver.is_empty(), a.driver.leak_report()


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize("conf, named", [
    ("max_split_size_mb:10", "max_split_size_mb"),
    ("max_split_size_mb:lots", "'lots'"),
    ("foo:1", "'foo'"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[256:3]", "256:3"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
    ("expandable_segments:maybe", "expandable_segments"),
    ("max_split_size_mb", "max_split_size_mb"),
    ("max_split_size_mb:128,", "trailing"),
    ("backend:cudaMallocAsync", "cudaMallocAsync"),
])
def test_bad_configuration_names_key_or_value(conf, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        make_allocator("pytorch-caching", config=conf)


def test_unknown_option_and_wrong_mode_are_config_errors():
    with pytest.raises(ConfigError, match="bad options"):
        make_allocator("pytorch-caching", max_split=3)
    with pytest.raises(ConfigError, match="pytorch-expandable"):
        make_allocator("pytorch-caching", config="expandable_segments:True")


def test_configuration_parses_as_pytorch_does():
    c = parse_alloc_conf(" max_split_size_mb : 128 , garbage_collection_threshold:0.8,"
                         "release_lock_on_cudamalloc:True,pinned_num_register_threads:4")
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.8
    assert c.inert == {"release_lock_on_cudamalloc": "True", "pinned_num_register_threads": "4"}
    # The list form: the first interval also covers smaller sizes; '>' refills from the last one named.
    c = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert c.roundup_power2_divisions == [1] * 9 + [8] * 7
    assert parse_alloc_conf(c.to_string()).roundup_power2_divisions == c.roundup_power2_divisions


# -- random sequences against the invariants --------------------------------------------------
SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 40 * MiB))
OPS = st.lists(st.tuples(st.sampled_from("af"), SIZES, st.integers(0, 1), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, conf=st.sampled_from(["", "max_split_size_mb:24", "roundup_power2_divisions:4",
                                     "per_process_memory_fraction:0.9,garbage_collection_threshold:0.5"]))
def test_random_sequences_keep_invariants(ops, conf):
    run_random_program(make(capacity=128 * MiB, config=conf), ops)


# -- fidelity on the real traces --------------------------------------------------------------
CACHING = bundled_trace_paths("caching")


class RecordedAddressDriver(SimulatedDriver):
    """Hands out the segment addresses the real cudaMalloc returned, in the order it did."""

    def __init__(self, addresses):
        super().__init__()
        self.addresses = list(addresses)

    def _mem_alloc(self, size):
        va = self.addresses.pop(0)
        self._allocs[va] = size
        return va


@pytest.mark.slow
@pytest.mark.parametrize("path", CACHING, ids=lambda p: p.name.split(".")[0])
def test_fidelity_peak_reserved_within_2_percent(path, bundled_trace):
    trace = bundled_trace(path)
    real = trace.recorded_peak_reserved()
    result = replay(trace, make_allocator("pytorch-caching"))
    assert not result.oom
    assert abs(result.peak_reserved - real) / real < 0.02, (result.peak_reserved, real)


@pytest.mark.slow
@pytest.mark.parametrize("path", CACHING, ids=lambda p: p.name.split(".")[0])
def test_every_allocation_lands_where_pytorch_put_it(path, bundled_trace):
    """Given the addresses the real cudaMalloc returned, the simulation makes the same
    segments, and every request lands at the address PyTorch gave it."""
    trace = bundled_trace(path)
    recorded = [e for e in trace.events if e.action.value == "segment_alloc"]
    d = RecordedAddressDriver(e.addr for e in recorded)
    a = PyTorchCachingAllocator(d)
    replay_at_recorded_addresses(a, trace)
    assert sorted(a.segments.items()) == sorted((e.addr, e.size) for e in recorded)
    assert d.peak_physical_bytes == trace.recorded_peak_reserved()
    a._check()
