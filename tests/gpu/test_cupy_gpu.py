"""On a real GPU with CuPy only (skipped elsewhere): CuPy arrays served by vmstoolkit allocators
compute what numpy computes, give their memory back, and a request the device cannot hold
raises CuPy's out-of-memory error and leaves the allocator usable.

Run on a GPU machine with ``VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_cupy_gpu.py -q``.
"""

import os

import numpy as np
import pytest

from vmstoolkit.units import GiB, MiB


def _cupy():
    if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy if cupy.cuda.is_available() else None


cp = _cupy()
pytestmark = pytest.mark.skipif(cp is None, reason="needs CuPy, a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


@pytest.fixture(params=["vms", "paged"])
def handle(request):
    import vmstoolkit.integrations.cupy as vc

    h = vc.install(request.param)
    yield h
    cp.cuda.Device().synchronize()
    h.uninstall()


def _allocated(h) -> int:
    return h.stats()["allocated_bytes.all.current"]


def test_cupy_computes_on_vmstoolkit_memory(handle):
    from vmstoolkit.integrations.cupy import _Owner

    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 768), dtype=np.float32)
    b = rng.standard_normal((768, 512), dtype=np.float32)
    before = _allocated(handle)
    da, db = cp.asarray(a), cp.asarray(b)
    dc = da @ db  # cuBLAS on vmstoolkit memory
    assert isinstance(dc.data.mem._owner, _Owner)
    assert _allocated(handle) >= before + a.nbytes + b.nbytes + dc.nbytes
    np.testing.assert_allclose(cp.asnumpy(dc), a @ b, rtol=1e-4, atol=1e-3)
    fma = cp.ElementwiseKernel("float32 x, float32 y", "float32 z", "z = x * y + 1.0f", "vms_test_fma")
    x = rng.standard_normal(3_000_000, dtype=np.float32)
    dx = cp.asarray(x)
    np.testing.assert_allclose(cp.asnumpy(fma(dx, dx)), x * x + 1, rtol=1e-6)
    # another stream: its allocations are made for it, and the results are the same
    with cp.cuda.Stream(non_blocking=True) as s:
        dy = cp.asarray(x) * 2
        total = float(dy.sum())
        s.synchronize()
    assert total == pytest.approx(float(2 * x.astype(np.float64).sum()), rel=1e-4)
    del da, db, dc, dx, dy
    cp.cuda.Device().synchronize()
    assert _allocated(handle) == before
    handle.allocator()._check()


def test_freed_memory_is_reused(handle):
    n = 64 * MiB
    first = cp.empty(n, dtype=cp.uint8)
    first.fill(1)
    reserved = handle.stats()["reserved_bytes.all.current"]
    allocs = handle.stats()["allocation.all.allocated"]
    del first
    for _ in range(5):  # same size, same stream: served from what the first one freed
        again = cp.empty(n, dtype=cp.uint8)
        again.fill(2)
        assert int(again[-1]) == 2
        del again
    s = handle.stats()
    assert s["reserved_bytes.all.current"] == reserved and s["allocation.all.allocated"] >= allocs + 5
    assert s["allocated_bytes.all.peak"] >= n
    handle.allocator()._check()


def test_out_of_memory_is_cupys_error_and_the_allocator_goes_on(handle):
    keep = cp.ones(16 * MiB, dtype=cp.uint8)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
        cp.empty(400 * GiB, dtype=cp.uint8)
    assert any("vmstoolkit" in n for n in getattr(info.value, "__notes__", []))
    assert handle.stats()["num_ooms"] >= 1
    after = cp.arange(1 << 20, dtype=cp.int64)
    assert int(after.sum()) == (1 << 20) * ((1 << 20) - 1) // 2
    assert int(keep.sum()) == 16 * MiB
    del keep, after
    handle.allocator()._check()
