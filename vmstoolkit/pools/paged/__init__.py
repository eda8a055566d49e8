"""The ``paged`` allocator: a compiled best-fit heap over one virtual range, pages mapped on demand."""

from vmstoolkit.pools.paged.allocator import PagedAllocator

__all__ = ["PagedAllocator"]
