"""Sizes and counts that more than one pool needs, each defined here once and explained.

>>> SMALL_SIZE == 1 << 20 and PAGE == 2 << 20
True
"""

from __future__ import annotations

from vmstoolkit.units import MiB

SMALL_SIZE = 1 * MiB
"""The largest *small* request: a request of at most this many bytes is small, a larger one is
large. PyTorch's caching allocator draws the line here (``kSmallSize`` in
``CUDACachingAllocator.cpp``: small requests share 2 MiB segments, large ones get their own), and
every pool of ours keeps it, so that the figures and ``memory_stats()`` read alike: ``vms`` and
``gmlake`` pack small requests in one-chunk segments (:mod:`vmstoolkit.pools.vmm.small`), ``paged``
serves them from its small heap, and the statistics adaptor counts them in ``small_pool``."""

PAGE = 2 * MiB
"""``cuMemGetAllocationGranularity`` on every GPU we target, and the simulated driver's."""

PAGED_MIN_BLOCKS = 16
"""Fewest block records ``paged`` starts each heap with (``max_blocks``). Every block, free or
live, holds one record, and the heaps double their records whenever they run out, so any count
works; below 16 the first few allocations already grow the arrays (and the PyTorch hook
republishes them), and a count of 0 once wrote outside them (issue 15, item 2). 16 still lets
tests run out of records on purpose."""

PAGED_MAX_BLOCKS = 1 << 27
"""Most block records ``paged`` starts a heap with: 37 bytes of host arrays each, 5 GiB for two
heaps at 2**27."""

__all__ = ["SMALL_SIZE", "PAGE", "PAGED_MIN_BLOCKS", "PAGED_MAX_BLOCKS"]
