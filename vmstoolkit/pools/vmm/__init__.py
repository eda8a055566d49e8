"""The stitching allocators on CUDA virtual memory (``gmlake`` and ``vms``).

:mod:`.allocator` holds :class:`~.allocator.VMMAllocator` and the two policies it is registered
under; it serves a request from three pools: :mod:`.primitive` (2 MiB-granular blocks, each one
physical allocation mapped into its own range), :mod:`.stitched` (non-adjacent free primitive
blocks mapped again, side by side, into one new range) and :mod:`.small` (requests of 1 MiB or
less, carved out of shared 2 MiB pages). :mod:`.blocks` holds the block records they share.
"""
