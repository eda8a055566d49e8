"""What the defragmenting allocators are measured against.

:mod:`.pytorch_caching` and :mod:`.pytorch_expandable` simulate PyTorch's CUDA caching allocator
in its two modes, configured by the same ``PYTORCH_CUDA_ALLOC_CONF`` settings
(:mod:`.pytorch_config`); :mod:`.native` maps every request to its own physical memory and
frees it at once (no caching, no fragmentation beyond rounding to the page).
"""
