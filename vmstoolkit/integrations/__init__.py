"""vmstoolkit allocators plugged into PyTorch (pluggable allocator), Numba (EMM plugin) and CuPy
(``cupy.cuda.set_allocator``).

The three modules share one shape, as RMM's ``rmm.allocators.{torch,numba,cupy}`` do:
``install(name="vms", **options)`` serves any registered allocator by name and returns a handle
whose ``bridge(device)`` is the device's :class:`~vmstoolkit.integrations.bridge.AllocatorBridge`
(its ``allocator``, ``stats()``), with ``memory_stats(device)`` in PyTorch's vocabulary;
the CuPy and Numba handles add ``allocator(device)`` and ``stats(device)``
(:class:`IntegrationHandle`), and CuPy, the one framework that allows it, ``uninstall()``.
Nothing in them names an allocator. The bridge is pure Python and tested on the simulated
driver; the framework-specific modules are thin.
"""

from vmstoolkit.integrations.bridge import AllocatorBridge, HandleStats, torch_style_stats


class IntegrationHandle(HandleStats):
    """What an integration's handle offers over its per-device ``bridge(device)``
    (``device=None``: the framework's current device)."""

    allocator_name = "abstract"

    def bridge(self, device: int | None = None) -> AllocatorBridge:
        raise NotImplementedError

    def allocator(self, device: int | None = None):
        """The device's allocator (:class:`~vmstoolkit.pools.base.Allocator`)."""
        return self.bridge(device).allocator

    def stats(self, device: int | None = None) -> dict:
        """The device's statistics in ``torch.cuda.memory_stats()`` names
        (:func:`~vmstoolkit.integrations.bridge.torch_stats`)."""
        return self.bridge(device).stats()


__all__ = ["AllocatorBridge", "IntegrationHandle", "torch_style_stats"]
