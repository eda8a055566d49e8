"""The simulated driver enforces the CUDA VMM rules and accounts physical memory exactly."""

import pytest

from vmstoolkit.errors import DriverError, DriverOutOfMemoryError
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import MiB

G = 2 * MiB


def test_map_set_access_alias_and_teardown():
    d = SimulatedDriver(capacity=8 * MiB)
    h = d.create(G)
    va1, va2 = d.reserve(G), d.reserve(2 * G)
    d.map(va1, G, h)
    d.map(va2 + G, G, h)  # the same chunk in a second range: stitching's alias
    assert d.aliases(h) == 2
    d.set_access(va1, G)
    d.memset(va1, G)
    with pytest.raises(DriverError, match="ILLEGAL_ADDRESS"):
        d.memset(va2 + G, G)  # mapped but no access yet
    with pytest.raises(DriverError, match="not fully mapped"):
        d.set_access(va2, 2 * G)
    d.unmap(va1, G)
    d.unmap(va2 + G, G)
    d.release(h)
    d.free_address(va1, G)
    d.free_address(va2, 2 * G)
    assert d.is_empty() and d.physical_bytes == 0 and d.peak_physical_bytes == G
    assert d.calls["map"] == 2 and d.calls["create"] == 1


@pytest.mark.parametrize("bad", ["outside", "overlap", "unaligned", "partial_unmap", "free_mapped", "released",
                                 "freed_reservation", "overlap_inside", "overlap_after", "unmap_two_pieces_and_hole"])
def test_rules_are_enforced(bad):
    d = SimulatedDriver()
    h = d.create(2 * G)
    g = d.create(G)  # mapped whole where one page is mapped (Note [whole handles])
    va = d.reserve(2 * G)
    with pytest.raises(DriverError, match="CUDA_ERROR"):
        if bad == "outside":
            d.map(va + G, 2 * G, h)
        elif bad == "overlap":
            d.map(va, 2 * G, h)
            d.map(va, G, g)
        elif bad == "unaligned":
            d.map(va + 4096, G, g)
        elif bad == "partial_unmap":
            d.map(va, 2 * G, h)
            d.unmap(va, G)
        elif bad == "free_mapped":
            d.map(va, 2 * G, h)
            d.free_address(va, 2 * G)
        elif bad == "released":
            d.release(g)
            d.map(va, G, g)
        elif bad == "freed_reservation":  # the range found last is forgotten when freed
            d.map(va, G, g)
            d.unmap(va, G)
            d.free_address(va, 2 * G)
            d.map(va, G, g)
        elif bad == "overlap_inside":  # starts inside an existing mapping
            d.map(va, 2 * G, h)
            d.map(va + G, G, g)
        elif bad == "overlap_after":  # covers the start of a later mapping
            d.map(va + G, G, g)
            d.map(va, 2 * G, h)
        elif bad == "unmap_two_pieces_and_hole":
            va2 = d.reserve(3 * G)
            d.map(va2, G, g)
            d.map(va2 + 2 * G, G, g)
            d.unmap(va2, 3 * G)


def test_plain_allocations_count_against_capacity():
    d = SimulatedDriver(capacity=3 * G)
    p = d.mem_alloc(2 * G)
    with pytest.raises(DriverOutOfMemoryError):
        d.create(2 * G)
    d.mem_free(p)
    h = d.create(2 * G)
    assert d.mem_info() == (G, 3 * G)
    d.release(h)
    assert d.is_empty()


def test_capacity_and_release_while_mapped():
    d = SimulatedDriver(capacity=2 * G)
    h1, h2 = d.create(G), d.create(G)
    with pytest.raises(DriverOutOfMemoryError, match="OUT_OF_MEMORY"):
        d.create(G)
    va = d.reserve(G)
    d.map(va, G, h1)
    d.release(h1)  # as in CUDA: the memory stays until its last mapping goes
    with pytest.raises(DriverOutOfMemoryError):
        d.create(G)
    d.unmap(va, G)
    h3 = d.create(G)
    for h in (h2, h3):
        d.release(h)
    d.free_address(va, G)
    assert d.is_empty()


def test_fault_injection_fails_exactly_the_nth_call():
    d = SimulatedDriver()
    d.fail_on("map", 2, "CUDA_ERROR_UNKNOWN")
    h, h2 = d.create(G), d.create(G)
    va = d.reserve(2 * G)
    d.map(va, G, h)
    with pytest.raises(DriverError, match="CUDA_ERROR_UNKNOWN: injected fault on call 2 of map"):
        d.map(va + G, G, h2)
    d.map(va + G, G, h2)  # the third call goes through
    with pytest.raises(ValueError, match="unknown driver operation"):
        d.fail_on("nope", 1)


@pytest.mark.parametrize("kind", ["sim-reference", "sim"])
@pytest.mark.parametrize("size, offset", [(G, 0), (G, G), (3 * G, 0)])
def test_a_handle_is_mapped_only_whole(kind, size, offset):
    """A CUDA driver maps a physical allocation only whole: on the H200 (driver 580.159.04)
    ``cuMemMap(va, 2 MiB, offset=0, h)`` of a 20 MiB handle is ``CUDA_ERROR_NOT_SUPPORTED``
    (experiments/results/train-h200/changing-shapes-run3). Past the handle's end stays
    ``CUDA_ERROR_INVALID_VALUE``; the whole handle maps, at several places too."""
    from vmstoolkit.pools.drivers import make_driver

    d = make_driver(kind, capacity=16 * MiB)
    h = d.create(2 * G)
    va = d.reserve(4 * G)
    code = "CUDA_ERROR_INVALID_VALUE" if offset + size > 2 * G else "CUDA_ERROR_NOT_SUPPORTED"
    with pytest.raises(DriverError, match=code):
        d.map(va, size, h, offset)
    assert d.calls["map"] == 1 and d.aliases(h) == 0
    d.map(va, 2 * G, h)
    d.map(va + 2 * G, 2 * G, h)
    assert d.aliases(h) == 2
