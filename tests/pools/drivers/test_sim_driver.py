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
    va = d.reserve(2 * G)
    with pytest.raises(DriverError, match="CUDA_ERROR"):
        if bad == "outside":
            d.map(va + G, 2 * G, h)
        elif bad == "overlap":
            d.map(va, 2 * G, h)
            d.map(va, G, h)
        elif bad == "unaligned":
            d.map(va + 4096, G, h)
        elif bad == "partial_unmap":
            d.map(va, 2 * G, h)
            d.unmap(va, G)
        elif bad == "free_mapped":
            d.map(va, 2 * G, h)
            d.free_address(va, 2 * G)
        elif bad == "released":
            d.release(h)
            d.map(va, G, h)
        elif bad == "freed_reservation":  # the range found last is forgotten when freed
            d.map(va, G, h)
            d.unmap(va, G)
            d.free_address(va, 2 * G)
            d.map(va, G, h)
        elif bad == "overlap_inside":  # starts inside an existing mapping
            d.map(va, 2 * G, h)
            d.map(va + G, G, h)
        elif bad == "overlap_after":  # covers the start of a later mapping
            d.map(va + G, G, h)
            d.map(va, 2 * G, h)
        elif bad == "unmap_two_pieces_and_hole":
            va2 = d.reserve(3 * G)
            d.map(va2, G, h)
            d.map(va2 + 2 * G, G, h)
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
    h = d.create(2 * G)
    va = d.reserve(2 * G)
    d.map(va, G, h)
    with pytest.raises(DriverError, match="CUDA_ERROR_UNKNOWN: injected fault on call 2 of map"):
        d.map(va + G, G, h, G)
    d.map(va + G, G, h, G)  # the third call goes through
    with pytest.raises(ValueError, match="unknown driver operation"):
        d.fail_on("nope", 1)
