"""The bookkeeping interface compiled paths report through (issue 35 item 2): export the base
class's counters, hand them back with what the compiled path did."""

import numpy as np
import pytest

from vmstoolkit.errors import DoubleFreeError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.base import Allocator


def test_export_and_report_round_trip():
    a = make_allocator("paged")
    x = a.allocate(1000)
    a.allocate(3000)
    a.free(x)
    c = a.export_counters()
    assert list(Allocator.COUNTERS) == ["allocated", "peak_allocated", "count", "peak_count", "total_allocs",
                                        "total_frees", "total_bytes"]
    assert c.tolist() == [3000, 4000, 1, 2, 2, 1, 4000] and c.dtype == np.int64
    # a compiled path served one more allocation of 500 bytes at y and freed nothing
    live = a.live_allocations()
    y = 1 << 44
    live[y] = 500
    c[0] += 500
    c[4] += 1
    c[6] += 500
    a.report_compiled(c, live=live, stream_of={y: 7}, home=0, freed=[x])
    s = a.stats()
    assert (s.allocated_bytes, s.peak_allocated_bytes, s.allocated_count, s.total_allocs, s.total_allocated_bytes) == \
        (3500, 4000, 2, 3, 4500)
    assert a.block_streams() == {y: 7} and a.stream_home() == 0 and a.size_of(y) == 500
    with pytest.raises(DoubleFreeError):
        a.free(x)  # the freed address reported is remembered
    a.note_oom()
    assert a.stats().num_ooms == 1
    a._live.pop(y)  # y was never really allocated: drop it before close checks the pools
    a.close()


def test_counters_kept_outside_read_as_the_allocators_own():
    """A compiled path that counts in its own array (the PyTorch hook) with count_alloc and
    count_free reads, through stats_of, what allocate and free give the base class."""
    from vmstoolkit.pools.base import count_alloc, count_free

    a, b = make_allocator("paged"), make_allocator("paged")
    c = b.export_counters()
    for size in (1000, 3 << 20, 7):
        addr = a.allocate(size)
        count_alloc(c, size)
    a.free(addr)
    count_free(c, 7)
    assert a.stats_of(a.export_counters()) == a.stats()
    got, want = b.stats_of(c).as_dict(), a.stats().as_dict()
    for k in ("allocated_bytes", "peak_allocated_bytes", "allocated_count", "peak_allocated_count", "total_allocs",
              "total_frees", "total_allocated_bytes"):
        assert got[k] == want[k], k
    a.reset_peak_stats()
    b.reset_peaks_of(c)
    a.reset_accumulated_stats()
    b.note_oom()
    b.reset_totals_of(c)
    got, want = b.stats_of(c).as_dict(), a.stats().as_dict()
    assert got["peak_allocated_bytes"] == want["peak_allocated_bytes"] == 1000 + (3 << 20)
    assert got["total_allocs"] == want["total_allocs"] == 0 and got["num_ooms"] == want["num_ooms"] == 0
    a.close()
    b.close()


def test_compiled_replay_uses_no_private_fields_of_the_base_class():
    import inspect

    from vmstoolkit.pools.paged import replay

    src = inspect.getsource(replay)
    for name in ("_allocated", "_peak_allocated", "_peak_count", "_total_allocs", "_total_frees", "_total_bytes",
                 "_num_ooms", "_live", "_recently_freed", "_streams"):
        assert f"a.{name}" not in src, name
