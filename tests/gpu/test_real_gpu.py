"""On a real GPU only (skipped elsewhere): the pools on CudaDriver, and the Numba and PyTorch
integrations end to end, each in a fresh process (allocators must be installed before the
framework's first CUDA allocation).

Run on a GPU machine with ``VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu -q``.
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from vmstoolkit.errors import NoGPUError
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.units import MiB


def _gpu() -> bool:
    if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
        return False
    try:
        make_driver("cuda").close()
        return True
    except NoGPUError:
        return False


pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("name", ["vms", "gmlake", "pytorch-expandable", "paged"])
def test_pools_on_the_real_driver(name):
    d = make_driver("cuda")
    a = make_allocator(name, d)
    ptrs = []
    for i, size in enumerate([3 * MiB, 100 << 10, 64 * MiB, 5 * MiB, 300 * MiB] * 4):
        ptrs.append(a.allocate(size))
        d.memset(ptrs[-1], size)
        if i % 3 == 2:
            a.free(ptrs.pop(0))
        a._check()
    d.synchronize()
    a.close()
    assert d.physical_bytes == 0
    d.close()


def test_every_call_works_from_a_thread_without_a_context():
    """PyTorch calls the allocator from threads with no current context (the autograd thread of
    save_on_cpu's unpack hook); cuCtxSynchronize failed there before the driver bound its own."""
    d = make_driver("cuda")
    out = {}

    def work():
        try:
            g = d.granularity
            h = d.create(g)
            va = d.reserve(2 * g)
            d.map(va, g, h)
            d.set_access(va, g)
            d.memset(va, g)
            d.synchronize()
            free, total = d.mem_info()
            d.unmap(va, g)
            d.free_address(va, 2 * g)
            d.release(h)
            p = d.mem_alloc(g)
            d.mem_free(p)
            out["ok"] = free < total
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == {"ok": True}, out
    assert d.physical_bytes == 0
    d.close()


def test_numba_device_arrays_come_from_vms():
    r = _python("""
        import numpy as np
        from vmstoolkit.integrations.numba import use_with_numba
        mm = use_with_numba("vms")
        from numba import cuda
        x = np.arange(3_000_000, dtype=np.float32)
        d = cuda.to_device(x)
        @cuda.jit
        def twice(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] *= 2
        twice[(x.size + 255) // 256, 256](d)
        assert (d.copy_to_host() == 2 * x).all()
        ctx = cuda.current_context()
        stats = ctx.memory_manager.stats()
        assert stats["allocated_bytes.all.current"] >= x.nbytes, stats
        del d
        print("ok", stats["reserved_bytes.all.peak"])
    """)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("name", ["vms", "paged"])
def test_torch_tensors_come_from_vmstoolkit_and_train(name):
    r = _python(f"""
        import vmstoolkit.integrations.torch as vt
        h = vt.install("{name}")
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(5):
            x = torch.randn(256, 1024, device="cuda")
            loss = model(x).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
        s = h.memory_stats()
        assert s["allocated_bytes.all.peak"] > 0 and s["reserved_bytes.all.peak"] >= s["allocated_bytes.all.peak"]
        b = h.bridge(0)
        assert b.failed_mallocs == 0 and getattr(b, "failed_frees", 0) == 0 and getattr(b, "bad_frees", 0) == 0
        print("ok", float(loss))
    """)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


def test_replay_cli_on_the_device(traces_dir):
    r = subprocess.run([sys.executable, "-m", "vmstoolkit", "replay", "--device", "cuda", "--touch", "-f", "json",
                        str(traces_dir / "llama-lora.caching.pickle.gz")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import json

    row = json.loads(r.stdout)
    assert abs(row["device_used_at_peak"] / row["peak_reserved"] - 1) < 0.01
