from hypothesis import given, settings
from hypothesis import strategies as st

from vmstoolkit.exec.region import OffsetAllocator


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=80))
def test_offset_allocator_invariants(ops):
    a = OffsetAllocator(400)
    live = []
    for i, (do_alloc, size) in enumerate(ops):
        if do_alloc or not live:
            off = a.allocate(size)
            if off is not None:
                assert 0 <= off and off + size <= 400
                for o, s in live:
                    assert off + size <= o or o + s <= off
                live.append((off, size))
        else:
            o, _ = live.pop(i % len(live))
            a.free(o, i)
        a._check()
        assert a.used == sum(s for _, s in live)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 60), st.integers(0, 3000)), max_size=150))
def test_allocate_takes_the_oldest_then_smallest_then_lowest_fit(ops):
    """The choice is the least (freed at, size, offset) among free ranges large enough, as a scan
    of every range finds it, also with times far beyond the index's first capacity (it grows)."""
    a = OffsetAllocator(1000)
    live = []
    for i, (do_alloc, size, when) in enumerate(ops):
        if do_alloc or not live:
            fits = [(t, s, o) for o, (s, t) in a._by_off.items() if s >= size]
            off = a.allocate(size)
            assert off == (min(fits)[2] if fits else None)
            if off is not None:
                live.append(off)
        else:
            a.free(live.pop(i % len(live)), when)
        a._check()


def test_allocator_prefers_oldest_hole():
    a = OffsetAllocator(300)
    x, y, z = a.allocate(100), a.allocate(100), a.allocate(100)
    a.free(y, when=5)
    a.free(x, when=1)  # x and y coalesce, freed at the later time, 5
    a.free(z, when=3)  # everything coalesces
    a._check()
    assert a._by_off[0] == (300, 5)
    a = OffsetAllocator(500)
    p = [a.allocate(100) for _ in range(5)]
    a.free(p[3], when=2)
    a.free(p[1], when=7)
    assert a.allocate(100) == p[3]  # the older hole, although both fit exactly


def test_empty_region_and_zero_bytes():
    assert OffsetAllocator(0).allocate(1) is None
    a = OffsetAllocator(100)
    assert a.allocate(100) == 0
    assert a.allocate(0) is None  # nothing free at all, as a scan finds
    a.free(0, when=4)
    assert a.allocate(0) == 0
