"""Issue 15's attacks on what PyTorch calls (items 1-4, 8): the compiled ``paged`` entry points and
the Python bridge, on the simulated driver. Each test reproduces a reported defect."""

import threading
import time

import pytest

from vmstoolkit.errors import ConfigError
from vmstoolkit.integrations.native_torch import ALLOC_FN, FREE_FN, G_BAD_FREES, NativeHook
from vmstoolkit.integrations.torch import TorchAllocatorHandle
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB, MiB


def _points(h):
    return ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)


@pytest.mark.parametrize("size", [2**63, 2**63 - 1, 2**64 - 1, 2**62, 300 * GiB])
def test_sizes_the_heap_cannot_hold_are_out_of_memory(hook, size, capsys):
    """Item 1: these segfaulted or returned a pointer that broke the heap."""
    alloc, free = _points(hook)
    p = alloc(1 << 20, 0, None)  # the device is warm: the compiled fast path is live
    assert p
    assert alloc(size, 0, None) is None
    assert "OutOfMemoryError" in type(hook.bridge(0).last_error).__name__
    free(p, 1 << 20, 0, None)
    hook.bridge(0).allocator._check()
    assert alloc(3 * MiB, 0, None)  # and it goes on


@pytest.mark.parametrize("max_blocks", [0, 1, 2, -1])
def test_too_few_block_records_is_a_clear_error(max_blocks):
    """Item 2: max_blocks=0 wrote outside its arrays."""
    with pytest.raises(ConfigError, match="max_blocks"):
        make_allocator("paged", max_blocks=max_blocks)


def test_interior_pointer_frees_are_refused_and_counted(hook):
    """Item 3: free(p + 4096) freed the block at p; the next allocation got p again."""
    alloc, free = _points(hook)
    p = alloc(3 * MiB, 0, None)
    s = alloc(1000, 0, None)
    free(p + 4096, 3 * MiB, 0, None)
    free(s + 256, 1000, 0, None)
    g = hook.bridge(0).g
    assert g[G_BAD_FREES] == 2
    q = alloc(3 * MiB, 0, None)
    t = alloc(1000, 0, None)
    assert q != p and t != s  # p and s are still live: nothing was freed
    assert hook.memory_stats(0)["active.all.current"] == 4
    hook.bridge(0).allocator._check()


def test_many_live_small_blocks_stay_in_the_small_heap():
    """Item 4: once block records ran out, each small block took a whole 2 MiB page. Records now
    grow on demand (here from 16), and the hook's table follows the new arrays."""
    h = NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB), max_blocks=16)
    try:
        alloc, free = _points(h)
        ptrs = [alloc(512, 0, None) for _ in range(5000)]
        assert all(ptrs) and len(set(ptrs)) == 5000
        pa = h.bridge(0).allocator
        assert all(pa.small.base <= p < pa.small.base + pa.small.nbytes for p in ptrs)
        assert pa.driver.physical_bytes <= 4 * MiB  # 5000 x 512 B = 2.4 MiB: two pages, not 5000
        for p in ptrs:
            free(p, 512, 0, None)
        pa._check()
        assert h.memory_stats(0)["active.all.current"] == 0
    finally:
        h.close()


def test_the_first_allocations_from_several_threads_make_one_allocator():
    """Item 8: bridge() had no lock; four threads on a fresh device made four allocators and
    frees reached the wrong one."""
    made = []

    def slow_driver(device):
        time.sleep(0.05)  # a real driver takes a while to start: the race window
        d = SimulatedDriver(capacity=8 * GiB)
        made.append(d)
        return d

    h = TorchAllocatorHandle("vms", slow_driver, {})
    errors = []

    def work(seed):
        try:
            for i in range(50):
                p = h._alloc((seed * 7 + i) % 5 * MiB + 512, 0, 0)
                assert p
                h._free(p, 0, 0, 0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(made) == 1
    b = h.bridge(0)
    assert b.failed_frees == 0 and b.allocator.allocated_bytes == 0
    b.allocator._check()


@pytest.mark.parametrize("name", ["vms", "gmlake", "native", "paged", "pytorch-caching", "pytorch-expandable"])
def test_seeded_threads_through_the_bridge_keep_every_invariant(name):
    """What the integrations serve is safe under concurrent calls (the bridge's lock); calling
    an allocator directly from several threads is not supported (its docstring says so)."""
    import random

    h = TorchAllocatorHandle(name, lambda device: SimulatedDriver(capacity=8 * GiB), {})
    streams = [0, 0x100, 0x200]

    def work(seed):
        rng = random.Random(seed)
        live = []
        for _ in range(300):
            if live and rng.random() < 0.45:
                p, s = live.pop(rng.randrange(len(live)))
                h._free(p, 0, 0, s)
            else:
                s = rng.choice(streams)
                p = h._alloc(rng.choice([512, 4000, 3 * MiB, 9 * MiB]), 0, s)
                if p:
                    live.append((p, s))
        for p, s in live:
            h._free(p, 0, 0, s)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b = h.bridge(0)
    assert b.failed_frees == 0
    b.allocator._check()
    b.allocator.close()
    assert b.allocator.driver.is_empty(), b.allocator.driver.leak_report()


def test_a_free_from_the_garbage_collector_inside_the_allocator_is_queued():
    """Seen on the H200: an allocation inside backward() ran Python's garbage collector, which
    dropped a tensor whose free called back into the bridge on the same thread: a deadlock on
    the bridge's lock. Such a free is now done when the outer call leaves."""
    h = TorchAllocatorHandle("vms", lambda device: SimulatedDriver(capacity=8 * GiB), {})
    b = h.bridge(0)
    victim = h._alloc(4 * MiB, 0, 0)
    real = b.allocator.allocate

    def allocate_and_collect(size, stream=0):
        h._free(victim, 4 * MiB, 0, 0)  # the collector frees a tensor right here
        return real(size, stream)

    b.allocator.allocate = allocate_and_collect
    done = []
    t = threading.Thread(target=lambda: done.append(h._alloc(MiB, 0, 0)))
    t.start()
    t.join(5)
    assert not t.is_alive(), "deadlock: the re-entering free waited for the lock its own thread holds"
    assert done[0] and b.allocator.allocated_bytes == MiB
    b.allocator._check()


@pytest.mark.parametrize("name", ["vms", "gmlake", "pytorch-expandable", "pytorch-caching", "native", "paged"])
def test_a_request_larger_than_the_device_fails_before_the_driver(name):
    """Item 12: vms, gmlake and expandable created and rolled back ~144k chunks first."""
    from vmstoolkit.errors import OutOfMemoryError

    d = SimulatedDriver(capacity=8 * GiB)
    a = make_allocator(name, d)
    before = sum(d.calls.values())
    with pytest.raises(OutOfMemoryError, match="larger than the device"):
        a.allocate(9 * GiB)
    assert sum(d.calls.values()) == before
    assert a.stats().num_ooms == 1
