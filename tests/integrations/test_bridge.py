"""The integration logic on the simulated driver: the C callbacks PyTorch would call, the
bridge Numba's plugin uses, PyTorch-vocabulary statistics, and clear errors without a GPU."""

import ctypes
import threading

import pytest

from vmstoolkit.errors import VmsError
from vmstoolkit.integrations import AllocatorBridge
from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN, make_handle
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.units import GiB, MiB


def test_ctypes_callbacks_through_raw_function_pointers(capsys):
    h = make_handle("vms", driver_factory=lambda device: make_driver("sim", capacity=1 * GiB))
    # call them exactly as C++ would: through the raw addresses handed to PyTorch
    alloc = ctypes.cast(h.alloc_ptr, ALLOC_FN)
    free = ctypes.cast(h.free_ptr, FREE_FN)
    ptrs = [alloc(size, 0, None) for size in (512, 3 * MiB, 100 * MiB)]
    assert all(ptrs) and len(set(ptrs)) == 3
    s = h.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 512 + 103 * MiB
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
    assert alloc(0, 0, None) is None  # size 0: the null pointer
    assert alloc(2 * GiB, 0, None) is None  # OOM: the null pointer, recorded
    b = h.bridges[0]
    assert b.failed_mallocs == 1 and "out of memory" in str(b.last_error)
    assert h.memory_stats(0)["num_ooms"] == 1
    # PyTorch does not check the pointer: the failure is said at once, with the size
    assert f"could not allocate {2 * GiB} bytes" in capsys.readouterr().err
    for p in ptrs:
        free(p, 0, 0, None)
    free(ptrs[0], 0, 0, None)  # double free: recorded, not raised into C
    assert b.failed_frees == 1 and "double free" in str(b.last_error)
    s = h.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 0 and s["allocated_bytes.all.peak"] == 512 + 103 * MiB
    h.reset_peak_memory_stats(0)
    assert h.max_memory_allocated(0) == 0
    b.allocator._check()


def test_devices_get_their_own_allocator():
    h = make_handle("gmlake", driver_factory=lambda device: make_driver("sim"))
    alloc = ctypes.cast(h.alloc_ptr, ALLOC_FN)
    alloc(4 * MiB, 0, None)
    alloc(4 * MiB, 1, None)
    assert set(h.bridges) == {0, 1}
    assert h.memory_stats(1)["allocated_bytes.all.current"] == 4 * MiB


def test_bridge_is_thread_safe():
    b = AllocatorBridge(make_allocator("vms"))

    def work():
        for _ in range(200):
            p = b.malloc(3 * MiB)
            b.free(p)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.failed_mallocs == b.failed_frees == 0
    b.allocator._check()
    assert b.stats()["allocation.all.allocated"] == 800


def test_bad_allocator_name_is_caught_early():
    with pytest.raises(VmsError, match="unknown allocator 'nope'"):
        make_handle("nope")


def test_numba_plugin_under_the_simulator_says_why_not(monkeypatch):
    from vmstoolkit.integrations.numba import make_memory_manager

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    with pytest.raises(VmsError, match="simulator.*has no external memory management"):
        make_memory_manager("vms")


def test_torch_install_without_torch_or_gpu_is_a_clear_error():
    from vmstoolkit.integrations import torch as vt

    try:
        import torch
    except ImportError:
        with pytest.raises(VmsError, match="PyTorch is not installed"):
            vt.install("vms")
        return
    if not torch.cuda.is_available():
        with pytest.raises(VmsError, match="PyTorch sees no CUDA GPU"):
            vt.install("vms")


def test_numba_plugin_logic_on_the_simulated_driver():
    """The EMM plugin class itself, outside Numba's CUDA simulator (which has no EMM), with the
    real driver swapped for the simulated one and a stand-in context: allocation, deferred
    frees as Numba defers them, the retry after flushing them, statistics."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc
        import logging
        import numba.cuda.cudadrv.driver as numba_driver
        import vmstoolkit.integrations.numba as vn
        # Numba defines its driver logger when it initialises a real driver; there is none here
        if not hasattr(numba_driver, "_logger"):
            numba_driver._logger = logging.getLogger("numba.cuda.cudadrv.driver")
        from vmstoolkit.pools import make_driver
        vn.make_driver = lambda kind, device=0: make_driver("sim", capacity="64MiB")
        MM = vn.make_memory_manager("vms")

        class Device:
            id = 0

        class Context:
            device = Device()

        ctx = Context()
        mm = MM(context=ctx)
        mm.initialize()
        assert mm.interface_version == 1
        # Numba runs deferred frees once they pass 20% of the device: 10 MiB of 64 stay queued
        keep = mm.memalloc(52 << 20)
        b = mm.memalloc(10 << 20)
        assert keep.size == 52 << 20 and int(b.device_pointer) != 0
        assert mm.stats()["allocated_bytes.all.current"] == 62 << 20
        del b
        gc.collect()
        assert mm.stats()["allocated_bytes.all.current"] == 62 << 20  # deferred, as Numba does
        c = mm.memalloc(10 << 20)  # fits only once the deferred free has run: flushed, retried
        assert mm.stats()["allocated_bytes.all.current"] == 62 << 20
        try:
            mm.memalloc(4 << 20)
        except Exception as e:
            assert "cannot allocate 4194304 bytes" in str(e), e
        else:
            raise AssertionError("no error on a full device")
        free, total = mm.get_memory_info()
        assert total == 64 << 20
        print("ok")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_an_adaptor_goes_around_the_allocator_between_calls_and_comes_off_again():
    from vmstoolkit.pools.adaptors import StatisticsAdaptor

    vms = make_allocator("vms")
    b = AllocatorBridge(vms)
    p = b.malloc(3 * MiB)
    stats = b.wrap(StatisticsAdaptor)
    q = b.malloc(5 * MiB)
    assert stats.statistics().current_bytes == 5 * MiB and b.stats()["allocated_bytes.large_pool.current"] == 5 * MiB
    b.unwrap(stats)
    assert b.allocator is vms
    b.free(p)
    b.free(q)
    assert b.failed_frees == 0 and vms.allocated_bytes == 0


def test_a_free_that_reenters_while_an_adaptor_is_put_on_is_queued_not_deadlocked():
    """The garbage collector may drop a tensor (whose deleter frees) inside any locked call."""
    from vmstoolkit.pools.adaptors import StatisticsAdaptor

    b = AllocatorBridge(make_allocator("vms"))
    p = b.malloc(3 * MiB)

    def make(a):
        b.free(p)  # as a deleter run by the garbage collector would, on this thread
        return StatisticsAdaptor(a)

    t = threading.Thread(target=b.wrap, args=(make,), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "wrap deadlocked on a re-entrant free"
    assert b.allocator.allocated_bytes == 0 and b.failed_frees == 0
