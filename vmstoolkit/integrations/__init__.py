"""vmstoolkit allocators plugged into Numba (EMM plugin) and PyTorch (pluggable allocator).

Both go through :class:`~vmstoolkit.integrations.bridge.AllocatorBridge`, which is pure Python
and tested on the simulated driver; the framework-specific modules are thin.
"""

from vmstoolkit.integrations.bridge import AllocatorBridge, torch_style_stats

__all__ = ["AllocatorBridge", "torch_style_stats"]
