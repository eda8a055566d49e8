"""The stitching allocators: each allocation path, aliasing, OOM only when memory truly lacks."""

import pytest

from vmstoolkit.errors import ConfigError, DoubleFreeError, InvalidFreeError, InvalidSizeError, OutOfMemoryError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import MiB

G = 2 * MiB


def vms(capacity=64 * G, **options):
    return make_allocator("vms", SimulatedDriver(capacity=capacity), **options)


def test_exact_split_and_reuse_without_driver_calls():
    a = vms()
    p = a.allocate(8 * G)
    assert a.counts["new"] == 1
    a.free(p)
    creates = a.driver.calls["create"]
    q = a.allocate(8 * G - 100)  # same chunk count: exact match
    assert q == p and a.counts["exact"] == 1
    a.free(q)
    r = a.allocate(3 * G)  # split the 8-chunk block
    assert r == p and a.counts["split"] == 1
    assert a.driver.calls["create"] == creates
    a._check()
    a.close()
    assert a.driver.is_empty()


def test_stitch_maps_the_same_chunks_in_one_new_range():
    a = vms()
    x, y, z = a.allocate(4 * G), a.allocate(2 * G), a.allocate(4 * G)
    a.free(x)
    a.free(z)  # 8 chunks free, in two non-adjacent blocks
    reserved = a.driver.physical_bytes
    s = a.allocate(8 * G)
    assert a.counts["stitch"] == 1
    assert a.driver.physical_bytes == reserved  # no new physical memory
    a.driver.memset(s, 8 * G)  # the whole stitched range is mapped and accessible
    block = a._blocks[s]
    handles = [h for p in block.parts for h in p.handles]
    assert len(handles) == 8 and all(a.driver.aliases(h) == 2 for h in handles)
    a._check()
    a.free(s)
    # the stitched range is cached: the same request reuses it with no new mapping
    maps = a.driver.calls["map"]
    assert a.allocate(8 * G) == s and a.driver.calls["map"] == maps
    a._check()
    a.close()
    assert a.driver.is_empty()


def test_missing_part_is_created_and_stitched():
    a = vms()
    x, keep = a.allocate(3 * G), a.allocate(G + 1)
    a.free(x)
    big = a.allocate(5 * G)  # 3 free chunks + 2 new ones
    assert a.counts["stitch_missing"] == 1
    assert a.driver.physical_bytes == (3 + 2 + 2) * G  # x, keep (G+1 takes 2 chunks), the missing 2
    a._check()
    for p in (big, keep):
        a.free(p)
    a.close()
    assert a.driver.is_empty()


def test_oom_only_when_memory_truly_lacks():
    a = vms(capacity=10 * G)
    ptrs = [a.allocate(2 * G) for _ in range(5)]  # device full
    for p in ptrs[::2]:
        a.free(p)  # 6 chunks free, scattered
    big = a.allocate(6 * G)  # served by stitching, no OOM
    a._check()
    with pytest.raises(OutOfMemoryError, match="out of memory allocating"):
        a.allocate(G + 1)
    a._check()
    assert a.stats().num_ooms == 1
    a.free(big)
    a.close()
    assert a.driver.is_empty()


def test_gmlake_below_threshold_creates_then_stitches_only_when_full():
    a = make_allocator("gmlake", SimulatedDriver(capacity=6 * G))
    x, y = a.allocate(2 * G), a.allocate(2 * G)
    a.free(x)
    a.free(y)
    # 4 free chunks in two blocks; 3 chunks < 512 MiB: GMLake splits one block... needs 3: no single
    # block fits, so it creates a new block while memory lasts...
    with pytest.raises(OutOfMemoryError):
        a.allocate(8 * G)
    p = a.allocate(3 * G)
    assert a.counts["new"] + a.counts["stitch"] + a.counts["stitch_missing"] >= 3
    a._check()
    a.free(p)
    a.close()
    assert a.driver.is_empty()


def test_small_requests_share_segments():
    a = vms()
    ptrs = [a.allocate(1000) for _ in range(100)]
    assert a.driver.physical_bytes == G  # 100 x 1024 B in one 2 MiB segment
    assert len(set(ptrs)) == 100
    a._check()
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    assert a.driver.physical_bytes == 0
    a._check()


@pytest.mark.parametrize("size", [0, -1, 2.5, "1"])
def test_bad_sizes_are_rejected_without_change(size):
    a = vms()
    with pytest.raises(InvalidSizeError, match="allocation size"):
        a.allocate(size)
    assert a.driver.calls.total() == 0


def test_double_and_unknown_free():
    a = vms()
    p = a.allocate(3 * G)
    a.free(p)
    with pytest.raises(DoubleFreeError, match=f"double free of address {p:#x}"):
        a.free(p)
    with pytest.raises(InvalidFreeError, match="unknown address 0x1234"):
        a.free(0x1234)
    a._check()


def test_policy_options_are_checked():
    with pytest.raises(ConfigError, match="unknown stitch policy option"):
        vms(nope=1)
    with pytest.raises(ConfigError, match="selection"):
        vms(selection="random")
    a = vms(stitch_min_bytes="1GiB")
    assert a.policy.stitch_min_bytes == 1 << 30
    with pytest.raises(ConfigError, match="unknown allocator 'vmz'"):
        make_allocator("vmz")


def test_stitched_cache_is_collected_under_its_limit():
    a = vms(max_cached_stitched=2)
    blocks = [a.allocate(2 * G) for _ in range(8)]
    for p in blocks[::2]:
        a.free(p)  # four free 1-chunk... 2-chunk blocks, not adjacent
    for n in (4, 6, 8):
        s = a.allocate(n * G)
        a.free(s)
        a._check()
    assert len(a.stitched.blocks) <= 2
    a.close()
    assert a.driver.is_empty()


def test_evictions_are_unmapped_in_batches_behind_one_sync():
    a = vms(capacity=256 * G, max_cached_stitched=1)
    ptrs = [a.allocate(G) for _ in range(80)]
    keep = ptrs[::2]
    for p in ptrs[1::2]:
        a.free(p)  # 40 free one-chunk blocks, none adjacent to another
    for n in range(3, 41):
        s = a.allocate(n * G)  # larger than any cached range: a new stitch, the old range evicted
        a.free(s)
        a._check()
    evicted = a.counts["stitch"] - 1
    assert evicted >= 30
    assert a.driver.syncs <= evicted // a.graveyard.DEFER_LIMIT + 1
    a.empty_cache()  # flushes what is still deferred
    assert not a.graveyard.deferred
    for p in keep:
        a.free(p)
    a.close()
    assert a.driver.is_empty()


def test_prefix_of_a_cached_stitched_range_costs_no_driver_call():
    a = vms()
    x, sep, y = a.allocate(4 * G), a.allocate(2 * G), a.allocate(4 * G)
    a.free(x)
    a.free(y)
    s = a.allocate(8 * G)  # stitched from x's and y's chunks
    a.free(s)
    calls = a.driver.calls.total()
    p = a.allocate(5 * G)  # no free block of 5 chunks: the first 5 chunks of the cached range
    assert a.counts["prefix"] == 1 and p == s
    assert a.driver.calls.total() == calls
    a.driver.memset(p, 5 * G)
    a._check()
    q = a.allocate(3 * G)  # the rest of the range's chunks are free for anyone
    assert a.driver.physical_bytes == 10 * G
    a._check()
    a.empty_cache()  # must not unmap the held range or release chunks it maps
    a.driver.memset(p, 5 * G)
    a._check()
    for ptr in (p, q, sep):
        a.free(ptr)
    a._check()
    assert a.allocate(8 * G) == s  # whole again, once the prefix is freed
    a.close()
    assert a.driver.is_empty()


def test_gmlake_does_not_take_prefixes():
    a = make_allocator("gmlake", SimulatedDriver(capacity=64 * G))
    assert not a.policy.stitched_prefix


def test_block_at_describes_what_backs_an_allocation():
    a = vms()
    x, sep, y = a.allocate(2 * G), a.allocate(G + 1), a.allocate(2 * G)
    small = a.allocate(1000)
    assert a.block_at(x).kind == "primitive" and len(a.block_at(x).handles) == 2
    assert a.block_at(small).kind == "small" and a.block_at(small).nbytes == 1024
    hx, hy = a.block_at(x).handles, a.block_at(y).handles
    a.free(x)
    a.free(y)
    s = a.allocate(4 * G)
    info = a.block_at(s)
    assert info.kind == "stitched" and info.nbytes == 4 * G
    assert set(info.handles) == set(hx) | set(hy) and len(info.parts) == 2
    with pytest.raises(InvalidFreeError, match="no live allocation"):
        a.block_at(x)


def _free_sizes(a):
    return sorted(n for n, _ in a.primitives.free_list)


def test_freed_neighbours_merge_back_without_driver_calls():
    a = vms()
    a.free(a.allocate(8 * G))  # one free 8-chunk block
    parts = [a.allocate(2 * G), a.allocate(2 * G), a.allocate(4 * G)]  # three splits of it
    calls = dict(a.driver.calls)
    for p in (parts[0], parts[2], parts[1]):  # the middle one last: it joins both sides
        a.free(p)
        a._check()
    assert _free_sizes(a) == [8] and a.primitives.merges == 2
    assert dict(a.driver.calls) == calls
    assert a.allocate(8 * G) == parts[0]  # served whole again: an exact match, no stitch
    a.close()
    assert a.driver.is_empty()


def test_no_merge_across_a_cached_range_that_maps_only_one_side():
    a = vms()
    a.free(a.allocate(4 * G))
    x, y, z, w = (a.allocate(G) for _ in range(4))  # four one-chunk blocks side by side
    a.free(x)
    a.free(z)  # x and z free, not adjacent: a two-chunk request stitches them
    s = a.allocate(2 * G)
    assert a.block_at(s).kind == "stitched"
    a.free(s)  # the cached range maps x then z
    a.free(y)  # y lies between x and z, but the range maps x right before z: no merge
    a._check()
    assert _free_sizes(a) == [1, 1, 1]
    a.free(w)  # w follows z, and no range maps w: z (mapped by the range) keeps apart
    a._check()
    assert _free_sizes(a) == [1, 1, 1, 1]
    a.close()
    assert a.driver.is_empty()


def test_merge_inside_a_cached_range_that_maps_both_in_order():
    a = vms()
    a.free(a.allocate(4 * G))
    x, y, z = (a.allocate(G) for _ in range(3))
    far = a.allocate(G)
    a.free(x)
    a.free(far)
    s = a.allocate(2 * G)  # stitches x and far
    a.free(s)
    # split far's neighbour chain: x stays one block; a range over [x, far]; now free y and z
    a.free(z)
    a.free(y)  # y + z merge (no range maps them); x + (y z) do not: the range maps x, then far
    a._check()
    assert sorted(_free_sizes(a)) == [1, 1, 2]
    a.close()
    assert a.driver.is_empty()


def test_prefix_of_a_cached_range_whose_tail_is_in_use():
    a = vms()
    ptrs = [a.allocate(G) for _ in range(8)]
    for p in ptrs[::2]:
        a.free(p)  # four free one-chunk blocks, apart
    big = a.allocate(4 * G)  # stitches all four
    a.free(big)
    tail = a.allocate(G)  # best fit: the lowest free block, which the range maps last
    rng = a.stitched.blocks[big]
    assert rng.busy == 1 and rng.parts[-1] is a.primitives.blocks[tail]
    calls = dict(a.driver.calls)
    p = a.allocate(2 * G)  # the range's first chunks are free: a prefix, no driver call
    assert p == big and a.block_at(p).kind == "stitched-prefix"
    assert dict(a.driver.calls) == calls
    a.free(p)
    a.free(tail)
    a._check()
    a.close()
    assert a.driver.is_empty()
