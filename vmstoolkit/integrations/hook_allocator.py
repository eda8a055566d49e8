"""The compiled hook PyTorch runs, driven through the allocator protocol's calls.

Replays and experiments that measure what PyTorch itself would get from ``paged``'s compiled
entry points (:mod:`vmstoolkit.integrations.native_torch`) use :class:`HookAllocator` instead of
wrapping the hook themselves: ``allocate``, ``free``, ``stats`` and ``close`` as on any
:class:`~vmstoolkit.pools.base.Allocator`. Its statistics are the hook's own counters, reported
through :meth:`~vmstoolkit.integrations.native_torch.NativeDevice.allocator_stats`.
"""

from __future__ import annotations

from vmstoolkit.errors import ConfigError, IntegrationError
from vmstoolkit.pools import make_driver
from vmstoolkit.pools.base import AllocatorStats
from vmstoolkit.pools.drivers.base import VMMDriver


class HookAllocator:
    """``allocator``'s compiled hook (``paged``'s) on ``driver`` (a fresh simulated one by
    default), device 0, behind ``allocate``/``free``. One per process at a time, as the hook."""

    def __init__(self, allocator: str = "paged", driver: VMMDriver | None = None, **options) -> None:
        from vmstoolkit.integrations.abi import ALLOC_FN, FREE_FN
        from vmstoolkit.integrations.torch import make_handle
        from vmstoolkit.pools.registry import compiled_hook

        if compiled_hook(allocator) is None:
            raise ConfigError(f"allocator {allocator!r} has no compiled hook (only Python callbacks serve PyTorch)")
        self.name = allocator
        self.driver = driver if driver is not None else make_driver("sim")
        self._hook = make_handle(allocator, driver_factory=lambda device: self.driver, **options)
        self._alloc, self._free = ALLOC_FN(self._hook.alloc_ptr), FREE_FN(self._hook.free_ptr)
        self._sizes: dict[int, int] = {}

    def allocate(self, size: int, stream: int = 0) -> int:
        ptr = self._alloc(size, 0, stream or None)
        if not ptr:
            raise IntegrationError(f"the {self.name} hook failed to allocate {size} bytes: {self._hook.last_error}")
        self._sizes[ptr] = size
        return ptr

    def free(self, ptr: int, stream: int | None = None) -> None:
        self._free(ptr, self._sizes.pop(ptr), 0, stream)

    def stats(self) -> AllocatorStats:
        return self._hook.bridge(0).allocator_stats()

    def close(self) -> None:
        self._hook.close()
