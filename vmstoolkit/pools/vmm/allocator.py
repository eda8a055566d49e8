"""Defragmenting allocators on CUDA virtual memory: ``gmlake`` and ``vms``.

A request of more than 1 MiB needs ``n`` chunks (the size rounded up to the 2 MiB granularity)
and is served by the first of these that works:

1. **exact match**: a free primitive block or a usable cached stitched block of ``n`` chunks;
2. **single block**: split the smallest larger free primitive block; else take the first ``n``
   chunks of the smallest larger usable cached stitched range (``stitched_prefix``: no driver
   call, no waste), or reuse a whole cached stitched range of at most ``reuse_max_ratio * n``
   chunks;
3. **stitch**: map free primitive blocks (``selection`` picks which) into one new range;
4. **stitch with the missing part**: create only the chunks that free memory lacks, as a new
   primitive block, and stitch it to every free block;
5. **out of memory**, only after destroying every idle stitched range and giving back empty
   small segments: physical memory truly cannot serve the request.

Below ``stitch_min_bytes`` steps 3 and 4 are skipped (a whole new block is created instead)
unless the device is full, when stitching is the last resort before OOM. Requests of 1 MiB or
less go to :class:`~vmstoolkit.pools.vmm.small.SmallPool`.
"""

from __future__ import annotations

from vmstoolkit.errors import DriverOutOfMemoryError, OutOfMemoryError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.vmm.blocks import BlockInfo, PrimitiveBlock, StitchedBlock, StitchedPrefix
from vmstoolkit.pools.drivers.base import VMMDriver
from vmstoolkit.pools.vmm.primitive import PrimitivePool
from vmstoolkit.pools.options import GMLakeOptions, StitchOptions, VmsOptions
from vmstoolkit.pools.registry import register_allocator
from vmstoolkit.pools.vmm.small import SmallPool
from vmstoolkit.pools.vmm.stitched import StitchedPool
from vmstoolkit.pools.drivers.teardown import Graveyard

GMLAKE_POLICY = GMLakeOptions()
"""GMLake's published policy (the defaults of :class:`~vmstoolkit.pools.options.GMLakeOptions`)."""

VMS_POLICY = VmsOptions()
"""Our policy: the defaults of :class:`~vmstoolkit.pools.options.VmsOptions`, where the figures behind
each of them stand."""


class VMMAllocator(Allocator):
    """Primitive pool + stitched pool + small pool, driven by a checked
    :class:`~vmstoolkit.pools.options.StitchOptions` (``gmlake``'s or ``vms``'s).

    Runtime complexity, with ``n`` the chunks a request needs, ``B`` the free primitive blocks
    and ``S`` the cached stitched ranges: a small request O(log s) in the small pool's ``s`` free
    blocks; a large one O(log B + log S) when a free block or a cached range fits (the range
    search skips at most ``StitchedPool.SCAN_LIMIT`` busy ones), O(n log B) when it stitches
    (each part taken from the sorted free list), plus the driver calls of what it creates or
    maps (one per chunk). A free is O(parts x log B), merging neighbours with ``coalesce``.
    Past ``max_cached_stitched`` ranges a new stitch also evicts the least recently used, O(S log S)."""

    def __init__(self, driver: VMMDriver, policy: StitchOptions, name: str) -> None:
        super().__init__(driver)
        self.name = name
        self.policy = policy
        self.g = driver.granularity
        self.graveyard = Graveyard(driver)
        self.primitives = PrimitivePool(driver, self.graveyard, coalesce=policy.coalesce)
        self.stitched = StitchedPool(driver, self.primitives, policy.max_cached_stitched)
        self.small = SmallPool(driver, self.graveyard)
        self._blocks: dict[int, PrimitiveBlock | StitchedBlock | StitchedPrefix] = {}  # live large blocks by address
        self.counts = {"exact": 0, "split": 0, "prefix": 0, "reuse_stitched": 0, "stitch": 0, "stitch_missing": 0, "new": 0, "small": 0}

    # -- allocate -------------------------------------------------------------------------
    def _allocate(self, size: int, stream: int) -> int:
        if size <= self.policy.small_size:
            return self._allocate_small(size)
        n = -(-size // self.g)
        try:
            return self._allocate_large(n, size)
        except DriverOutOfMemoryError:
            self._reclaim()
            try:
                return self._allocate_large(n, size, last_resort=True)
            except DriverOutOfMemoryError as e:
                raise self._oom(size, e) from None

    def _allocate_large(self, n: int, size: int, last_resort: bool = False) -> int:
        prim, st, policy, counts = self.primitives, self.stitched, self.policy, self.counts
        p = prim.best_fit(n)
        if p is not None and p.nchunks == n:  # _use_primitive(p, "exact"), inline: most requests
            prim.take(p, p)
            self._blocks[p.va] = p
            counts["exact"] += 1
            return p.va
        s = st.best_fit(n, n)
        if s is not None:
            return self._use_stitched(s, "exact")
        if p is not None:
            head = prim.split_take(p, n)
            self._blocks[head.va] = head
            counts["split"] += 1
            return head.va
        if policy.stitched_prefix:
            s = st.best_prefix(n)
            if s is not None:
                prefix = st.take_prefix(s, n)
                self._blocks[prefix.va] = prefix
                counts["prefix"] += 1
                return prefix.va
        reuse_max = int(n * policy.reuse_max_ratio)
        s = st.best_fit(n, reuse_max) if reuse_max > n else None  # up to n: the lookup above, again
        if s is not None:
            return self._use_stitched(s, "reuse_stitched")
        may_stitch = last_resort or size >= policy.stitch_min_bytes
        if may_stitch and prim.free_chunks >= n:
            return self._use_stitched(st.stitch(self._select(n)), "stitch")
        if may_stitch and prim.free_chunks > 0:
            prim.create(n - prim.free_chunks)  # only the missing chunks, as one new free block
            parts = [prim.blocks[va] for va in sorted(va for _, va in prim.free_list)]
            return self._use_stitched(st.stitch(parts), "stitch_missing")
        return self._use_primitive(prim.create(n), "new")

    def _select(self, n: int) -> list[PrimitiveBlock]:
        """Free primitive blocks holding exactly ``n`` chunks (splitting the last one)."""
        prim = self.primitives
        parts: list[PrimitiveBlock] = []
        chosen: set[PrimitiveBlock] = set()
        need = n
        if self.policy.selection == "best-fit":
            while need > 0:
                b = prim.best_fit(need)
                if b is None or b in chosen:
                    b = next(x for x in prim.iter_free(largest_first=True) if x not in chosen)
                if b.nchunks > need:
                    b, _ = prim.split(b, need)
                parts.append(b)
                chosen.add(b)
                need -= b.nchunks
        else:  # largest-first
            for b in prim.free_blocks(largest_first=True):
                if need == 0:
                    break
                if b.nchunks > need:
                    b, _ = prim.split(b, need)
                parts.append(b)
                need -= b.nchunks
        return parts

    def _use_primitive(self, p: PrimitiveBlock, how: str) -> int:
        self.primitives.take(p, p)
        self._blocks[p.va] = p
        self.counts[how] += 1
        return p.va

    def _use_stitched(self, s: StitchedBlock, how: str) -> int:
        self.stitched.take(s)
        self._blocks[s.va] = s
        self.counts[how] += 1
        return s.va

    def _allocate_small(self, size: int) -> int:
        self.counts["small"] += 1
        try:
            return self.small.allocate(size)
        except DriverOutOfMemoryError:
            pass
        self._reclaim()
        # Still full: give one free primitive block's chunks back so a segment fits.
        while True:
            try:
                return self.small.allocate(size)
            except DriverOutOfMemoryError as e:
                self.stitched.destroy_idle()
                victim = next((b for b in self.primitives.iter_free() if not b.stitched), None)
                if victim is None:
                    raise self._oom(size, e) from None
                self.primitives.release(victim)

    def _reclaim(self) -> None:
        """Destroy idle stitched ranges and give back empty small segments."""
        self.graveyard.flush()
        self.stitched.destroy_idle()
        self.small.release_empty()

    def _oom(self, size: int, err: Exception) -> OutOfMemoryError:
        d = self.driver
        free_cached = self.primitives.free_chunks * self.g
        return OutOfMemoryError(
            f"{self.name}: out of memory allocating {size} bytes: {d.physical_bytes} bytes held "
            f"({free_cached} of them free and cached), device capacity {d.capacity} ({err})",
            requested=size, reserved=d.physical_bytes, capacity=d.capacity)

    # -- free -----------------------------------------------------------------------------
    def _free(self, addr: int) -> None:
        b = self._blocks.pop(addr, None)
        if b is None:
            self.small.free(addr)  # not a large block: a small one (the base class checked it is live)
            return
        t = type(b)
        if t is PrimitiveBlock:
            self.primitives.give_back_many((b,))  # give_back(b), one call fewer: most frees
        elif t is StitchedBlock:
            self.stitched.give_back(b)
        else:
            self.stitched.give_back_prefix(b)

    def block_at(self, addr: int) -> BlockInfo:
        """What backs the live allocation at ``addr`` (see :class:`~vmstoolkit.pools.vmm.blocks.BlockInfo`).
        Runtime complexity: O(chunks of the block)."""
        self.size_of(addr)  # raises InvalidFreeError naming the address if nothing lives there
        if self.small.owns(addr):
            b = self.small.used[addr]
            return BlockInfo("small", addr, b.size, (b.seg.handle,))
        b = self._blocks[addr]
        kind = {PrimitiveBlock: "primitive", StitchedBlock: "stitched", StitchedPrefix: "stitched-prefix"}[type(b)]
        parts = () if isinstance(b, PrimitiveBlock) else tuple((p.va, p.nchunks) for p in b.parts)
        return BlockInfo(kind, b.va, b.nchunks * self.g, tuple(b.handles), parts)

    def _empty_cache(self) -> None:
        """Unmap every idle stitched range, give back every free primitive block and empty
        small segment. Live allocations keep their memory. Teardown steps that failed
        earlier are retried first."""
        self.graveyard.retry()
        self.stitched.destroy_idle()
        for b in self.primitives.free_blocks():
            if not b.stitched:  # free parts of a range held through a prefix stay
                self.primitives.release(b)
        self.small.release_empty()

    # -- invariants -----------------------------------------------------------------------
    def _check(self) -> None:
        """Assert the three pools' invariants and that, together with the graveyard, they hold
        exactly the driver's physical bytes, handles, mappings and reservations (no leak, no
        dead handle). Runtime complexity: O(blocks + chunks + stitched parts)."""
        super()._check()
        owned = self.primitives._check()
        self.stitched._check(self.primitives.blocks)
        small_handles = self.small._check()
        g = self.g
        core = self._held_by_core()
        large_live = {a for a in core if not self.small.owns(a)}
        assert set(self._blocks) == large_live, "allocated blocks differ from live large allocations"
        for addr, b in self._blocks.items():
            if isinstance(b, StitchedPrefix):
                assert b.stitched.prefix is b, f"{b} is live but its range does not know it"
            elif isinstance(b, StitchedBlock):
                assert b.allocated and b.prefix is None, f"{b} is live but not marked allocated whole"
            else:
                assert b.user is b, f"{b} is live but used by {b.user}"
            assert b.nchunks * g >= core[addr], f"block at {addr:#x} smaller than its request"
        gy = self.graveyard
        reserved = (self.primitives.total_chunks + len(self.small.segments)) * g + gy.held_bytes()
        assert reserved == self.driver.physical_bytes, f"pools hold {reserved} bytes, driver counts {self.driver.physical_bytes}"
        if self.driver.lists_resources:
            d = self.driver
            assert d.live_handles() == owned | small_handles | gy.handles(), "driver handles that no block owns (leak) or blocks with dead handles"
            n_maps = self.primitives.total_chunks + sum(s.nchunks for s in self.stitched.blocks.values()) + len(self.small.segments) + gy.mappings()
            assert len(d.live_mappings()) == n_maps, f"driver has {len(d.live_mappings())} mappings, pools account for {n_maps}"
            res = {b.res.va for b in self.primitives.blocks.values()} | set(self.stitched.blocks) | set(self.small.segments) | gy.reservations()
            assert set(d.live_reservations()) == res, "driver reservations differ from the pools' ranges"


@register_allocator("gmlake", GMLakeOptions, "GMLake (ASPLOS'24) defaults: stitch requests >= 512 MiB, reuse stitched <= 10x, largest first")
def make_gmlake(driver: VMMDriver, options: GMLakeOptions = GMLAKE_POLICY) -> VMMAllocator:
    """``gmlake`` over ``driver``. Runtime complexity: O(1)."""
    return VMMAllocator(driver, options, "gmlake")


@register_allocator("vms", VmsOptions, "our VMM stitching policy: stitch every large request, best-fit parts, serve smaller requests from cached stitched prefixes")
def make_vms(driver: VMMDriver, options: VmsOptions = VMS_POLICY) -> VMMAllocator:
    """``vms`` over ``driver``. Runtime complexity: O(1)."""
    return VMMAllocator(driver, options, "vms")
