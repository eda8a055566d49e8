"""``PyTorchCachingAllocator``'s segment source: cudaMalloc by default, or any vmstoolkit
allocator (``torch.cuda.MemPool`` over a pluggable allocator: PyTorch's caching on top)."""

import pytest

from vmstoolkit.errors import OutOfMemoryError
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.pools.baselines.pytorch_caching import AllocatorSegments, DriverSegments, PyTorchCachingAllocator
from vmstoolkit.units import MiB


def test_segments_from_an_allocator_are_its_live_allocations():
    d = make_driver("sim", capacity=256 * MiB)
    a = PyTorchCachingAllocator(d, "max_split_size_mb:40", segments=lambda d: AllocatorSegments(make_allocator("vms", d)))
    vms = a.segment_source.upstream
    assert d.calls.get("mem_alloc", 0) == 0
    p = a.allocate(3 * MiB)  # a 20 MiB segment from vms, split
    q = a.allocate(5 * MiB)
    assert q - p == 3 * MiB and vms.live_allocations() == {p: 20 * MiB}
    r = a.allocate(50 * MiB)
    assert vms.live_allocations()[r] == 50 * MiB and d.calls.get("mem_alloc", 0) == 0  # no cudaMalloc at all
    a._check()
    for x in (p, q, r):
        a.free(x)
    a._check()
    assert len(vms.live_allocations()) == 2  # cached in the caching allocator, live in vms
    a.empty_cache()
    a._check()
    assert vms.live_allocations() == {} and a.stats().reserved_bytes == d.physical_bytes
    a.close()
    assert d.physical_bytes == 0  # vms closed with it


def test_a_private_pool_keeps_cached_blocks_on_the_last_retry():
    """keeps_cached: only the oversize retry gives cached memory back; the default source frees
    every whole cached segment before out of memory."""
    for keeps, served in ((True, False), (False, True)):
        d = make_driver("sim", capacity=64 * MiB)
        a = PyTorchCachingAllocator(d, segments=lambda d: AllocatorSegments(make_allocator("vms", d), keeps_cached=keeps))
        a.free(a.allocate(40 * MiB))  # a cached 40 MiB segment (no max_split: never released on the first retry)
        if served:  # another stream's request: the cached block cannot serve it, its memory can
            a.free(a.allocate(30 * MiB, 1), 1)
        else:
            with pytest.raises(OutOfMemoryError):
                a.allocate(30 * MiB, 1)
        a._check()
        a.close()


def test_the_default_source_is_cudamalloc_and_a_source_on_another_driver_fails_the_check():
    d = make_driver("sim")
    a = PyTorchCachingAllocator(d)
    assert isinstance(a.segment_source, DriverSegments)
    a.free(a.allocate(3 * MiB))
    assert d.calls["mem_alloc"] == 1
    a.close()
    a = PyTorchCachingAllocator(d, segments=lambda _: AllocatorSegments(make_allocator("vms", make_driver("sim"))))
    a.allocate(3 * MiB)
    with pytest.raises(AssertionError, match="another driver"):
        a._check()


def test_garbage_collection_leaves_a_private_pool_alone():
    """PyTorch's garbage collection (``garbage_collect_cached_blocks``) walks the default large
    pool only: a MemPool's cached segments stay, where cudaMalloc-ed ones go (the case of
    test_pytorch_caching's ``test_garbage_collection_frees_old_blocks_first``)."""
    conf = "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5"
    for keeps, reserved in ((False, 130 * MiB), (True, 180 * MiB)):
        d = make_driver("sim", capacity=400 * MiB)
        a = PyTorchCachingAllocator(d, conf, segments=lambda d: AllocatorSegments(make_allocator("vms", d), keeps_cached=keeps))
        a.free(a.allocate(50 * MiB))
        a.free(a.allocate(60 * MiB))
        a.allocate(70 * MiB)  # 110 MiB cached, over the 100 MiB threshold: the older 50 MiB go, unless in a pool
        assert a.stats().reserved_bytes == reserved and a.segment_source.upstream.stats().allocated_bytes == reserved
        a._check()
        a.close()
