"""vmstoolkit: see, measure and beat GPU memory fragmentation.

The package is laid out by architecture:

- ``vmstoolkit.pools``: VMM drivers (simulated and real) and every allocator (VMM stitching
  pools, PyTorch baselines, native malloc/free), all behind one protocol;
- ``vmstoolkit.trace``: PyTorch memory snapshots, typed events, and replay;
- ``vmstoolkit.exec``: task graphs, the memory-graph compiler with CPU offload, executors;
- ``vmstoolkit.kernels``: Numba CUDA kernels of a LLaMA decoder block, with numpy references;
- ``vmstoolkit.integrations``: the allocators plugged into Numba and PyTorch;
- ``vmstoolkit.cli``: the ``vmstoolkit`` command;
- ``vmstoolkit.record``: record a PyTorch run's memory history (:mod:`vmstoolkit.recording`).
"""

from vmstoolkit._version import __version__  # noqa: E402,F401

from vmstoolkit.recording import record  # noqa: E402  (imports torch only when recording starts)
