"""``native``: the cudaMalloc/cudaFree baseline. Every request gets its own physical memory,
rounded up to the granularity, mapped at once and given back at once on free: no caching, no
reuse, the most driver calls and no fragmentation beyond rounding."""

from __future__ import annotations

from vmstoolkit.errors import DriverOutOfMemoryError, OutOfMemoryError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.options import NoOptions
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.drivers.teardown import Graveyard, unmap_range_steps
from vmstoolkit.pools.drivers.txn import map_new_range
from vmstoolkit.units import round_up


@register_allocator("native", NoOptions, "cudaMalloc/cudaFree baseline: own chunks per request, freed at once")
class NativeAllocator(Allocator):
    """Every request its own range of fresh chunks, given back at its free: what the program
    would hold with no caching at all. Runtime complexity: O(1) per allocation and free, plus
    their driver calls (a reserve, one create and one map of the rounded size, a set_access; the
    reverse at the free)."""

    name = "native"

    def __init__(self, driver: VMMDriver, options: NoOptions = NoOptions()) -> None:
        super().__init__(driver)
        self._ranges: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.graveyard = Graveyard(driver)

    def _allocate(self, size: int, stream: int) -> int:
        d = self.driver
        nbytes = round_up(size, d.granularity)
        try:
            va, h = map_new_range(d, nbytes, self.graveyard)
        except DriverOutOfMemoryError as e:
            raise OutOfMemoryError(
                f"native: out of memory allocating {size} bytes ({nbytes} physical) with {d.physical_bytes} in use: {e}",
                requested=size, reserved=d.physical_bytes, capacity=d.capacity) from None
        self._ranges[va] = (nbytes, h)
        return va

    def _free(self, addr: int) -> None:
        nbytes, h = self._ranges.pop(addr)
        self.graveyard.run(unmap_range_steps(addr, nbytes, h))

    def _empty_cache(self) -> None:
        """Nothing is cached; only teardown steps that failed earlier are retried."""
        self.graveyard.retry()

    def _check(self) -> None:
        """Assert one mapped range per live request, granule-aligned, and the driver's count of
        physical bytes. Runtime complexity: O(live)."""
        super()._check()
        assert set(self._ranges) == set(self._held_by_core()), "native: mapped ranges differ from live allocations"
        held = sum(n for n, _ in self._ranges.values()) + self.graveyard.held_bytes()
        assert held == self.driver.physical_bytes, f"native: holds {held} bytes, driver counts {self.driver.physical_bytes}"
        g = self.driver.granularity
        core = self._held_by_core()
        for va, (nbytes, _) in self._ranges.items():
            assert va % g == 0 and nbytes % g == 0, f"native: range {va:#x}+{nbytes} not granule-aligned"
            assert nbytes >= core[va], f"native: range {va:#x}+{nbytes} smaller than its request {core[va]}"
