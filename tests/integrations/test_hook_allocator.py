"""The compiled hook behind the allocator protocol (what experiments replay through): its
figures are those of ``paged`` through Python on the same requests."""

from vmstoolkit.integrations.hook_allocator import HookAllocator
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB, MiB


def test_the_hook_reads_as_paged_through_python():
    sizes = [100, 3 * MiB, 5000, 64 * MiB, MiB, MiB + 1]
    results = []
    for a in (HookAllocator("paged", SimulatedDriver(capacity=4 * GiB)), make_allocator("paged", SimulatedDriver(capacity=4 * GiB))):
        ptrs = [a.allocate(s) for s in sizes]
        for p in ptrs[::2]:
            a.free(p)
        ptrs.append(a.allocate(3 * MiB))  # pages already mapped: the compiled fast path
        s = a.stats()
        results.append((s.allocated_bytes, s.peak_allocated_bytes, s.allocated_count, s.peak_allocated_count,
                        s.reserved_bytes, s.total_allocs, s.total_frees, s.total_allocated_bytes, s.num_ooms))
        a.close()
    assert results[0] == results[1]
    assert results[0][5] == len(sizes) + 1 and results[0][6] == 3
