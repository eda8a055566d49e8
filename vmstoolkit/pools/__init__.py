"""Drivers and allocators. Every allocator speaks :class:`~vmstoolkit.pools.base.Allocator`.

The tree shows the design:

- :mod:`.drivers`: the driver seam (interface, simulated, CUDA, the :func:`make_driver` factory)
  and the driver-call sequences every pool shares (transactions, teardown);
- :mod:`.base` (the protocol), :mod:`.streams` (stream-ordered reuse), :mod:`.adaptors`
  (limits, statistics and logging around any allocator), :mod:`.options` (each allocator's
  options, one dataclass each) and :mod:`.registry` (allocators by name);
- :mod:`.vmm`: the stitching allocators ``gmlake`` and ``vms``;
- :mod:`.paged`: the compiled best-fit heap over one large range;
- :mod:`.baselines`: PyTorch's caching allocator in both modes, and ``native``.

Import this package to register every allocator; then build one by name with
:func:`make_allocator`.
"""

import importlib as _importlib
import sys as _sys

from vmstoolkit.pools.base import Allocator, AllocatorStats
from vmstoolkit.pools.drivers import VMMDriver, make_driver
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.pools.registry import allocator_names, describe_allocators, make_allocator, register_allocator

# Importing an allocator module registers it (the registry is the one list of names).
from vmstoolkit.pools.baselines import native as _native  # noqa: E402,F401
from vmstoolkit.pools.vmm import allocator as _vmm  # noqa: E402,F401
from vmstoolkit.pools.baselines import pytorch_caching as _pytorch_caching  # noqa: E402,F401
from vmstoolkit.pools.baselines import pytorch_expandable as _pytorch_expandable  # noqa: E402,F401
from vmstoolkit.pools import paged as _paged  # noqa: E402,F401

# Module paths before the tree was split into subpackages (0.x, issue 19). They keep working
# for code written against them; new code imports the new paths.
_MOVED = {
    "driver": "drivers.base", "sim_driver": "drivers.sim", "txn": "drivers.txn",
    "teardown": "drivers.teardown", "primitive": "vmm.primitive", "stitched": "vmm.stitched",
    "small": "vmm.small", "blocks": "vmm.blocks", "vmm_allocator": "vmm.allocator",
    "pytorch_caching": "baselines.pytorch_caching", "pytorch_expandable": "baselines.pytorch_expandable",
    "pytorch_config": "baselines.pytorch_config", "native": "baselines.native",
}
for _old, _new in _MOVED.items():
    _sys.modules[f"{__name__}.{_old}"] = _importlib.import_module(f"{__name__}.{_new}")

__all__ = [
    "Allocator", "AllocatorStats", "VMMDriver", "SimulatedDriver", "make_driver",
    "make_allocator", "allocator_names", "describe_allocators", "register_allocator",
]
