"""The blocks of the VMM pools: reservations, primitive blocks and stitched blocks.

A *primitive block* owns whole physical chunks (one ``cuMemCreate`` handle per chunk of the
driver's granularity), each mapped at its place in the block's own virtual range. Splitting a
free primitive block at a chunk boundary gives two primitive blocks that share the reservation
(:class:`Reservation` counts them, so the range is freed with the last one). With the policy's
``coalesce`` two free neighbours of one reservation merge again (unless a cached stitched range
maps only one of them); stitching is what joins free memory across reservations.

A *stitched block* owns no memory: its one contiguous virtual range maps, in order, the chunks
of several primitive blocks (the same handles are then mapped in two places). It can be
allocated whole while every one of those primitive blocks is free (``busy`` counts those that
are not), or through its first chunks while those are free (:class:`StitchedPrefix`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vmstoolkit.pools.drivers.base import Handle


VA_BITS = 64
"""Bits of a device address (``CUdeviceptr`` is 64-bit)."""


def free_key(nchunks: int, va: int) -> int:
    """``(nchunks, va)`` as one int that sorts the same way: ``nchunks << 64 | va``. The primitive
    pool's free list holds these (ints compare in one C call, a tuple in up to three, and a
    block's key is made once, not per lookup); ``key >> VA_BITS`` and ``key & VA_MASK`` give
    the two back. Runtime complexity: O(1)."""
    return nchunks << VA_BITS | va


VA_MASK = (1 << VA_BITS) - 1


class Reservation:
    """A virtual range from ``reserve``; freed when no primitive block lives in it."""

    __slots__ = ("va", "size", "refs")

    def __init__(self, va: int, size: int) -> None:
        self.va = va
        self.size = size
        self.refs = 0


class PrimitiveBlock:
    """Chunks ``handles`` mapped at ``va, va+g, ...`` inside ``res``.

    ``user`` is ``None`` when free, the block itself when allocated directly, or the stitched
    block it is part of while that one is allocated. ``stitched`` holds the cached stitched
    blocks whose ranges map its chunks.
    """

    __slots__ = ("va", "handles", "nchunks", "key", "res", "user", "stitched")

    def __init__(self, va: int, handles: list[Handle], res: Reservation) -> None:
        self.va = va
        self.handles = handles  # replaced, never changed in place: a split cuts it, a merge extends it
        self.nchunks = len(handles)  # read on every pool operation: a slot, not a property
        self.key = self.nchunks << VA_BITS | va  # free_key(nchunks, va), inline: its place on the free list
        self.res = res
        self.user: object | None = None
        self.stitched: set[StitchedBlock] = set()
        res.refs += 1

    @property
    def free(self) -> bool:
        """No allocation (its own, or a stitched range's) uses the block. Runtime complexity: O(1)."""
        return self.user is None

    def __repr__(self) -> str:
        return f"<PrimitiveBlock {self.va:#x} x{self.nchunks} {'free' if self.free else 'used'}>"


class StitchedBlock:
    """A virtual range of ``nchunks`` chunks mapping the chunks of ``parts`` in order."""

    __slots__ = ("va", "nchunks", "parts", "busy", "allocated", "last_use", "prefix")

    def __init__(self, va: int, nchunks: int, parts: list[PrimitiveBlock]) -> None:
        self.va = va
        self.nchunks = nchunks
        self.parts = parts
        self.busy = sum(1 for p in parts if p.user is not None)  # parts not free
        self.allocated = False  # held whole, or through a prefix (then ``prefix`` is set)
        self.last_use = 0
        self.prefix: StitchedPrefix | None = None

    @property
    def handles(self) -> list:
        """The physical chunks this range maps, in address order. Runtime complexity: O(chunks)."""
        return [h for p in self.parts for h in p.handles]

    @property
    def usable(self) -> bool:
        """Every part is free and the range is not allocated: it may serve a request whole.
        Runtime complexity: O(1)."""
        return self.busy == 0 and not self.allocated

    def __repr__(self) -> str:
        return f"<StitchedBlock {self.va:#x} x{self.nchunks} parts={len(self.parts)} busy={self.busy}>"


class StitchedPrefix:
    """An allocation of the first ``nchunks`` chunks of a cached stitched range.

    The range is already mapped and accessible, so serving a smaller request from its start
    costs no driver call and wastes nothing: ``parts`` are the primitive blocks under those
    chunks (the last one split at the boundary if needed); the rest of the range's chunks stay
    free for anyone. The stitched block is held (not destroyed, not reused) meanwhile.
    """

    __slots__ = ("va", "nchunks", "parts", "stitched")

    def __init__(self, stitched: StitchedBlock, nchunks: int, parts: list[PrimitiveBlock]) -> None:
        self.va = stitched.va
        self.nchunks = nchunks
        self.parts = parts
        self.stitched = stitched

    @property
    def handles(self) -> list:
        """The physical chunks the prefix maps, in address order. Runtime complexity: O(chunks)."""
        return [h for p in self.parts for h in p.handles]

    def __repr__(self) -> str:
        return f"<StitchedPrefix {self.va:#x} x{self.nchunks} of {self.stitched.nchunks}>"


@dataclass(frozen=True)
class BlockInfo:
    """What backs one live allocation (for teaching, debugging and tests).

    ``kind`` is ``"small"`` (inside a one-chunk small-pool segment), ``"primitive"``,
    ``"stitched"`` or ``"stitched-prefix"``; ``handles`` are the physical chunks mapped under
    ``[va, va + nbytes)`` in order; ``parts`` the ``(va, chunks)`` of the primitive blocks whose
    chunks a stitched range maps.
    """

    kind: str
    va: int
    nbytes: int
    handles: tuple
    parts: tuple = ()
