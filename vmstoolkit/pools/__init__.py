"""Drivers and allocators. Every allocator speaks :class:`~vmstoolkit.pools.base.Allocator`.

Import this package to register every allocator; then build one by name with
:func:`make_allocator`.
"""

from vmstoolkit.pools.base import Allocator, AllocatorStats
from vmstoolkit.pools.driver import VMMDriver, make_driver
from vmstoolkit.pools.registry import allocator_names, describe_allocators, make_allocator, register_allocator
from vmstoolkit.pools.sim_driver import SimulatedDriver

# Importing an allocator module registers it (the registry is the one list of names).
from vmstoolkit.pools import native as _native  # noqa: E402,F401
from vmstoolkit.pools import vmm_allocator as _vmm  # noqa: E402,F401
from vmstoolkit.pools import pytorch_caching as _pytorch_caching  # noqa: E402,F401
from vmstoolkit.pools import pytorch_expandable as _pytorch_expandable  # noqa: E402,F401
from vmstoolkit.pools import paged as _paged  # noqa: E402,F401

__all__ = [
    "Allocator", "AllocatorStats", "VMMDriver", "SimulatedDriver", "make_driver",
    "make_allocator", "allocator_names", "describe_allocators", "register_allocator",
]
