"""Fixtures of the runtime's tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def sim_gpu(monkeypatch):
    """The real CudaBackend on the CUDA simulator, its region a numpy byte array."""
    from numba import config, cuda

    if not config.ENABLE_CUDASIM:
        pytest.skip("runs on Numba's CUDA simulator (tests/gpu/test_host_memory_gpu.py is the GPU's)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    regions: dict[int, np.ndarray] = {}

    def take_region(gpu, nbytes, peers=(), *, allocator="vms", options=None):
        addr = (len(regions) + 1) << 20
        regions[addr] = np.zeros(nbytes, np.uint8)
        return addr, lambda: regions.pop(addr)

    def device_view(ctx, base, offset, shape, dtype):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return FakeCUDAArray(regions[base][offset:offset + n].view(dtype).reshape(shape))

    class Event:
        def record(self, stream):
            pass

        def query(self):
            return True

        def wait(self, stream):  # the simulator runs every stream's work at once, in order
            pass

    import vmstoolkit.exec.backends.cuda as cuda_backend

    monkeypatch.setattr(cuda_backend, "take_region", take_region)
    monkeypatch.setattr(cuda_backend, "device_view", device_view)
    monkeypatch.setattr(cuda, "event", lambda timing=True: Event())
    return regions
