"""Private memory pools, with the semantics PyTorch gives CUDA graphs (``CUDACachingAllocator``'s
``beginAllocateToPool`` / ``endAllocateToPool`` / ``releasePool``), over any allocator.

A captured CUDA graph replays kernels at the addresses it was captured with. So while a graph is
captured its allocations come from a pool of its own, and memory freed inside the pool is given
only to later allocations *of that pool*, never to the rest of the program, until the pool is
released: an eager tensor allocated between two replays then never lies where a replay writes.

- :meth:`PrivatePools.use` creates a pool (keyed by PyTorch's mempool id, a pair of ints) or
  adds one use to it: a capture that begins, a ``MemPool``, a graph sharing another's pool
  (``torch.cuda.graph(pool=...)``);
- :meth:`PrivatePools.allocate` serves a request of the pool: from a block freed inside it
  (the smallest that fits, no split, at most :data:`REUSE_SLACK` larger or twice the request),
  or from the upstream allocator;
- :meth:`PrivatePools.free` keeps a block freed inside a pool cached for the pool;
- :meth:`PrivatePools.release` takes one use away; at zero the cached blocks go back upstream
  at once, and the blocks still live go back as they are freed; then the pool is gone;
- :meth:`PrivatePools.take_back` makes a cached block live again at its address (cudagraph
  trees' ``setCheckpointPoolState`` restores a pool to a checkpoint so).

Which allocation goes to which pool is not decided here: PyTorch's capture filter decides it
(the compiled shim, ``integrations/csrc/torch_shim.cpp``, calls the filter and tags each block).

``upstream`` is anything with ``allocate(size, stream) -> addr`` and ``free(addr, stream)``
(an :class:`~vmstoolkit.pools.base.Allocator`). Not thread-safe: callers hold a lock.
Cost: a dict lookup per free, a sorted-list search per allocation of a pool.

>>> from vmstoolkit.pools import make_allocator, make_driver
>>> pools = PrivatePools(make_allocator("native", make_driver("sim", capacity="1GiB")))
>>> _ = pools.use((1, 0)); a = pools.allocate((1, 0), 4096, 0); pools.free(a)
>>> pools.allocate((1, 0), 4096, 0) == a     # reused inside the pool only
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sortedcontainers import SortedList

from vmstoolkit.errors import ConfigError, InvalidFreeError
from vmstoolkit.units import MiB

REUSE_SLACK = 2 * MiB
"""A cached block serves a request when it is at most this much larger, or at most twice the request."""

PoolId = tuple[int, int]


@dataclass
class PrivatePool:
    """One pool: its uses, its live blocks and the blocks freed inside it."""

    id: PoolId
    use_count: int = 0
    live: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """address -> (requested size, block size, stream) of the blocks handed out."""
    cached: SortedList = field(default_factory=SortedList)
    """(block size, address) of the blocks freed inside the pool."""
    streams: dict[int, int] = field(default_factory=dict)
    """address -> stream of every cached block (where upstream allocated it)."""

    @property
    def cached_bytes(self) -> int:
        """Bytes of the pool's cached (freed, kept) blocks. Runtime complexity: O(cached blocks)."""
        return sum(size for size, _ in self.cached)

    @property
    def live_bytes(self) -> int:
        """Requested bytes of the pool's live allocations. Runtime complexity: O(live)."""
        return sum(req for req, _, _ in self.live.values())


class PrivatePools:
    """The private pools of one device over ``upstream`` (see the module)."""

    def __init__(self, upstream) -> None:
        self.upstream = upstream
        self.pools: dict[PoolId, PrivatePool] = {}
        self._owner: dict[int, PoolId] = {}  # address -> pool, for every block a pool holds

    def __len__(self) -> int:
        return len(self.pools)

    def _pool(self, pool_id) -> PrivatePool:
        pool = self.pools.get(tuple(pool_id))
        if pool is None:
            raise ConfigError(f"no private pool {tuple(pool_id)} (a capture or MemPool must use it first)")
        return pool

    def use(self, pool_id) -> int:
        """One more use of the pool (made when absent); returns its use count. Runtime complexity:
        O(1); no upstream call."""
        key = tuple(int(x) for x in pool_id)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = PrivatePool(key)
        pool.use_count += 1
        return pool.use_count

    def use_count(self, pool_id) -> int:
        """How many holders the pool ``pool_id`` has (0 for a pool never made or already given back).
        Runtime complexity: O(1)."""
        pool = self.pools.get(tuple(pool_id))
        return 0 if pool is None else pool.use_count

    def owner(self, addr: int) -> PoolId | None:
        """The pool holding the block at ``addr`` (live or cached), or None. Runtime complexity: O(1)."""
        return self._owner.get(addr)

    def allocate(self, pool_id, size: int, stream: int = 0) -> int:
        """A block of at least ``size`` bytes from the pool: a cached one of ``stream`` that fits,
        else upstream's. Runtime complexity: O(log(c) + k) in the pool's cached blocks c and the k
        fitting ones of other streams passed over, plus the upstream's allocate on a miss."""
        pool = self._pool(pool_id)
        if pool.use_count <= 0:
            raise ConfigError(f"private pool {pool.id} was released: nothing may be allocated from it")
        # the smallest cached block that fits within the slack, among those of the asking stream: a
        # block freed on another stream may still be read by that stream's queued work (PyTorch's
        # pools key their blocks by stream too)
        i = pool.cached.bisect_left((size, -1))
        while i < len(pool.cached):
            bsize, addr = pool.cached[i]
            if not (bsize - size <= REUSE_SLACK or bsize <= 2 * size):
                break
            if pool.streams[addr] == stream:
                del pool.cached[i]
                pool.live[addr] = (size, bsize, pool.streams.pop(addr))
                return addr
            i += 1
        addr = self.upstream.allocate(size, stream)
        pool.live[addr] = (size, size, stream)
        self._owner[addr] = pool.id
        return addr

    def free(self, addr: int) -> None:
        """The pool's block at ``addr`` is free: cached for the pool, or upstream's again once
        the pool is released. Runtime complexity: O(log(c)) while the pool is in use; once released,
        the upstream's free plus O(1)."""
        key = self._owner.get(addr)
        if key is None or addr not in self.pools[key].live:
            raise InvalidFreeError(f"free of address {addr:#x}, which no private pool has handed out")
        pool = self.pools[key]
        _, bsize, stream = pool.live.pop(addr)
        if pool.use_count > 0:
            pool.cached.add((bsize, addr))
            pool.streams[addr] = stream
            return
        del self._owner[addr]
        try:
            self.upstream.free(addr, stream)
        finally:
            self._forget_if_empty(pool)

    def take_back(self, pool_id, addr: int, size: int) -> bool:
        """Make the cached block at ``addr`` live again for a request of ``size`` bytes; False when
        the pool does not cache such a block. Runtime complexity: O(c) in the pool's cached blocks (a
        scan); no upstream call."""
        pool = self.pools.get(tuple(pool_id))
        if pool is None or pool.use_count <= 0 or addr not in pool.streams:
            return False
        bsize = None
        for b, a in pool.cached:  # a scan: restoring a checkpoint is rare
            if a == addr:
                bsize = b
                break
        if bsize is None or bsize < size:
            return False
        pool.cached.remove((bsize, addr))
        pool.live[addr] = (size, bsize, pool.streams.pop(addr))
        return True

    def release(self, pool_id) -> int:
        """One use less; at zero, give the cached blocks back upstream (the live ones follow as they
        are freed). Returns the use count left. Runtime complexity: O(1), or at zero O(c) plus c
        upstream frees for the c cached blocks."""
        pool = self._pool(pool_id)
        if pool.use_count <= 0:
            raise ConfigError(f"private pool {pool.id} released more often than it was used")
        pool.use_count -= 1
        if pool.use_count == 0:
            self._give_back(pool)
        return pool.use_count

    def _give_back(self, pool: PrivatePool) -> None:
        cached = list(pool.cached)
        pool.cached.clear()
        first: Exception | None = None
        for _, addr in cached:
            del self._owner[addr]
            try:
                self.upstream.free(addr, pool.streams.pop(addr))
            except Exception as e:  # keep giving back; the first error is raised after
                first = first or e
        self._forget_if_empty(pool)
        if first is not None:
            raise first

    def _forget_if_empty(self, pool: PrivatePool) -> None:
        if pool.use_count == 0 and not pool.live and not pool.cached:
            self.pools.pop(pool.id, None)

    def live_blocks(self, pool_id) -> dict[int, int]:
        """address -> requested size of the pool's live blocks (a copy). Runtime complexity: O(live
        blocks of the pool)."""
        pool = self.pools.get(tuple(pool_id))
        return {} if pool is None else {a: req for a, (req, _, _) in pool.live.items()}

    @property
    def cached_bytes(self) -> int:
        """Bytes of blocks freed inside pools and kept for them (allocated upstream, free for PyTorch).
        Runtime complexity: O(cached blocks of every pool)."""
        return sum(p.cached_bytes for p in self.pools.values())

    def _check(self) -> None:
        for key, pool in self.pools.items():
            assert pool.use_count >= 0, f"pool {key} has a negative use count"
            for addr in pool.live:
                assert self._owner.get(addr) == key, f"live block {addr:#x} of {key} has no owner"
            for _, addr in pool.cached:
                assert self._owner.get(addr) == key and addr in pool.streams, f"cached block {addr:#x} of {key}"
            assert not (set(pool.live) & {a for _, a in pool.cached}), f"a block of {key} is both live and cached"
            assert pool.use_count > 0 or not pool.cached, f"released pool {key} still caches blocks"


__all__ = ["PoolId", "PrivatePool", "PrivatePools", "REUSE_SLACK"]
