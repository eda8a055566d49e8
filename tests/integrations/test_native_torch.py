"""PyTorch's hook served by compiled code (``paged``), driven through its raw C entry points on
the simulated driver, from a Python thread and from a native thread as PyTorch would."""

import pytest

from vmstoolkit.integrations.testing import roundtrips_from_native_thread
from vmstoolkit.integrations.native_torch import ALLOC_FN, FREE_FN, G_BAD_FREES, NativeHook
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB, MiB


def _entry_points(h):
    return ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)


def test_allocations_and_frees_through_the_c_entry_points(hook):
    alloc, free = _entry_points(hook)
    sizes = [100, 3 * MiB, 5000, 64 * MiB, MiB, MiB + 1]
    ptrs = [alloc(s, 0, None) for s in sizes]
    assert all(ptrs) and len(set(ptrs)) == len(ptrs)
    nd = hook.bridge(0)
    for p, s in zip(ptrs, sizes):
        nd.allocator.driver.memset(p, s)  # mapped and accessible
    st = hook.memory_stats(0)
    assert st["allocated_bytes.all.current"] == sum(sizes) and st["active.all.current"] == len(sizes)
    assert st["reserved_bytes.all.current"] == nd.allocator.driver.physical_bytes > 0
    for p, s in zip(ptrs, sizes):
        free(p, s, 0, None)
    st = hook.memory_stats(0)
    assert st["allocated_bytes.all.current"] == 0 and st["allocation.all.freed"] == len(sizes)
    assert hook.max_memory_allocated(0) == sum(sizes)
    nd.allocator._check()


def test_a_later_hook_reuses_the_compiled_entry_points_and_its_slow_path_serves_it():
    # compiled once per process (2.5 s of CPU per hook before): the second hook's entry points are
    # the first's, and their slow path (a new device's first allocation) reaches the second hook
    first = NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB))
    ptrs = (first.alloc_ptr, first.free_ptr)
    first.close()
    second = NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB))
    try:
        assert (second.alloc_ptr, second.free_ptr) == ptrs
        alloc, free = _entry_points(second)
        p = alloc(3 * MiB, 0, None)
        assert p and second.devices_in_use() == [0] and not first.devices
        assert second.memory_stats(0)["allocated_bytes.all.current"] == 3 * MiB
        free(p, 3 * MiB, 0, None)
        assert second.memory_stats(0)["allocated_bytes.all.current"] == 0
    finally:
        second.close()


def test_close_gives_everything_back_with_blocks_still_live():
    drivers = []

    def factory(device):
        drivers.append(SimulatedDriver(capacity=4 * GiB))
        return drivers[-1]

    h = NativeHook(factory)
    try:
        alloc, free = _entry_points(h)
        ptrs = [alloc(s, 0, None) for s in (100, 3 * MiB, 64 * MiB, 5000)]
        free(ptrs[1], 3 * MiB, 0, None)  # one freed, three still live (as a model's weights at exit)
        d = drivers[0]
        assert d.physical_bytes > 0 and d._mappings
    finally:
        h.close()
    assert d.physical_bytes == 0 and not d._mappings and not d._reservations


def test_large_blocks_in_units_finer_than_a_page_share_pages():
    h = NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB), large_unit=512 << 10)
    try:
        alloc, free = _entry_points(h)
        sizes = [MiB + 1, 3 * MiB + 512, 1536 << 10, 5 * MiB]  # 3 + 7 + 3 + 10 units of 512 KiB
        ptrs = [alloc(s, 0, None) for s in sizes]
        nd = h.bridge(0)
        for p, s in zip(ptrs, sizes):
            nd.allocator.driver.memset(p, s)
        assert [b - a for a, b in zip(ptrs, ptrs[1:])] == [3 << 19, 7 << 19, 3 << 19]  # packed at 512 KiB
        assert nd.allocator.driver.physical_bytes == 6 * 2 * MiB  # 11.5 MiB of blocks on 6 pages (2 MiB units: 9)
        for p, s in zip(ptrs, sizes):
            free(p, s, 0, None)
        nd.allocator._check()
    finally:
        h.close()


def test_warm_round_trips_never_reach_python(hook):
    alloc, free = _entry_points(hook)
    free(alloc(4 * MiB, 0, None), 4 * MiB, 0, None)  # maps the pages (slow path, once)
    nd = hook.bridge(0)
    seconds, calls = nd.seconds, dict(nd.allocator.driver.calls)
    for _ in range(200):
        free(alloc(4 * MiB, 0, None), 4 * MiB, 0, None)
    assert nd.seconds == seconds, "the Python slow path ran"
    assert dict(nd.allocator.driver.calls) == calls
    assert hook.memory_stats(0)["allocation.all.allocated"] == 201


def test_from_a_native_thread(hook):
    ok, _ = roundtrips_from_native_thread(hook.alloc_ptr, hook.free_ptr, 3 * MiB, 500)
    assert ok == 500
    st = hook.memory_stats(0)
    assert st["allocation.all.allocated"] == st["allocation.all.freed"] == 500
    hook.bridge(0).allocator._check()


def test_a_busy_device_sends_the_fast_path_to_python(hook):
    alloc, free = _entry_points(hook)
    free(alloc(4 * MiB, 0, None), 4 * MiB, 0, None)
    nd = hook.bridge(0)
    nd.g[H.G_BUSY] = 1  # as while another thread's slow path works
    try:
        seconds = nd.seconds
        p = alloc(4 * MiB, 0, None)
        assert p and nd.seconds > seconds
    finally:
        nd.g[H.G_BUSY] = 0
    free(p, 4 * MiB, 0, None)
    assert hook.memory_stats(0)["allocated_bytes.all.current"] == 0
    nd.allocator._check()


def test_failures_return_null_and_are_recorded(hook, capsys):
    alloc, free = _entry_points(hook)
    keep = alloc(3 * GiB, 0, None)
    assert keep
    assert alloc(2 * GiB, 0, None) is None  # the 4 GiB device is full
    nd = hook.bridge(0)
    assert nd.failed_mallocs == 1 and str(2 * GiB) in str(nd.last_error)
    # PyTorch does not check the pointer it gets: the failure is said at once
    assert f"could not allocate {2 * GiB} bytes on device 0" in capsys.readouterr().err
    nd.allocator._check()
    free(0x1234, 8, 0, None)  # not ours
    assert nd.g[G_BAD_FREES] == 1
    assert alloc(0, 0, None) is None  # size 0: the null pointer, as PyTorch expects
    assert alloc(1, 99, None) is None and "device 99" in str(hook.last_error)
    assert "could not allocate 1 bytes on device 99" in capsys.readouterr().err
    free(keep, 3 * GiB, 0, None)
    assert hook.memory_stats(0)["allocated_bytes.all.current"] == 0


def test_devices_get_their_own_heaps(hook):
    alloc, free = _entry_points(hook)
    a, b = alloc(3 * MiB, 0, None), alloc(3 * MiB, 1, None)
    assert a and b and hook.bridge(0).allocator is not hook.bridge(1).allocator
    free(a, 3 * MiB, 0, None)
    free(b, 3 * MiB, 1, None)
    assert hook.memory_stats(1)["allocation.all.freed"] == 1


def test_one_hook_per_process(hook):
    with pytest.raises(RuntimeError, match="already owns"):
        NativeHook(lambda device: make_driver("sim"))


def test_install_paged_without_torch_or_gpu_is_a_clear_error():
    from vmstoolkit.errors import NoGPUError, VmsError
    from vmstoolkit.integrations.torch import install

    with pytest.raises((VmsError, NoGPUError)):
        install("paged")



def test_install_paged_hands_pytorch_the_compiled_pointers(monkeypatch):
    """``install("paged")`` against a stand-in for torch: the pointers PyTorch receives are the
    hook's; with no GPU behind them an allocation returns null and says why."""
    import sys
    import types

    from vmstoolkit.errors import NoGPUError, VmsError
    from vmstoolkit.integrations import torch as vt

    seen = {}
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: True)
    fake.Tensor = type("Tensor", (), {"record_stream": lambda self, stream: None})
    fake._C = types.SimpleNamespace(
        _cuda_customAllocator=lambda a, f: seen.setdefault("pointers", (a, f)) and "allocator",
        _cuda_changeCurrentAllocator=lambda alloc: seen.setdefault("installed", alloc))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(vt, "_INSTALLED", None)
    h = vt.install("paged")  # the stand-in has no extension builder: the bare hook, patched in Python
    try:
        assert seen["pointers"] == (h.alloc_ptr, h.free_ptr) and seen["installed"] == "allocator"
        assert not h.raises and "cpp_extension" in h.shim_reason
        assert fake.Tensor.record_stream is not None and callable(fake._C._cuda_memoryStats)
        assert vt.install("paged") is h
        with pytest.raises(VmsError, match="already installed"):
            vt.install("vms")
        alloc, _ = _entry_points(h)
        assert alloc(1 << 20, 0, None) is None  # this machine has no GPU
        assert isinstance(h.last_error, NoGPUError), repr(h.last_error)
    finally:
        h.close()


@pytest.mark.parametrize("name", ["paged", "vms"])
def test_install_with_the_shim_hands_it_every_entry_point(monkeypatch, name):
    """With the shim built (a stand-in here), it receives the twelve entry points, whether they
    run Python (the Python allocators' do: the shim keeps a Python exception in flight out of their
    way) and the handle to keep alive; the handle leaves failed allocations to it (no report on
    stderr: the shim raises torch.OutOfMemoryError), and PyTorch's snapshot functions answer from it."""
    import sys
    import types

    from vmstoolkit.integrations import torch as vt

    seen = {}
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: True)
    fake._C = types.SimpleNamespace()
    shim = types.SimpleNamespace(install=lambda p, python, keep: seen.update(pointers=tuple(p), python=python, keep=keep),
                                 live_blocks=lambda: [])
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(vt, "_INSTALLED", None)
    monkeypatch.setattr(vt, "_load_shim", lambda: (shim, ""))
    h = vt.install(name)
    try:
        assert seen["pointers"] == h.shim_pointers and len(set(h.shim_pointers)) == 12
        assert seen["python"] is (name != "paged") and seen["keep"] is h
        assert h.raises
        assert fake._C._cuda_isHistoryEnabled() is False
        fake._C._cuda_record_memory_history("all", "all", "python", 10)
        assert fake._C._cuda_isHistoryEnabled() is True
        snap = fake._C._cuda_memorySnapshot(None)
        assert set(snap) >= {"segments", "device_traces"}
        fake._C._cuda_record_memory_history(None)
        assert fake._C._cuda_isHistoryEnabled() is False
    finally:
        if name == "paged":
            h.close()


def test_two_native_threads_at_once_keep_the_heap_consistent():
    """PyTorch may allocate from its autograd thread while the main thread does too: two native
    threads hammer the hook at once with sizes that keep sending it down the slow path (pages to
    map and reclaim on a small device); the GIL and the busy flag must keep the heap whole."""
    import ctypes as C

    import numba
    import numpy as np
    from numba import carray, cfunc, types

    h = NativeHook(lambda device: SimulatedDriver(capacity=96 * MiB))
    try:
        alloc, free = ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)

        @cfunc(types.voidptr(types.CPointer(types.int64)))
        def body(args):  # args: [n sizes, rounds, failures (out), sizes...]
            sizes = carray(args, args[0] + 3)
            bad = 0
            nul = numba.uint64(0)
            for _ in range(args[1]):
                for i in range(args[0]):
                    s = numba.uint64(sizes[3 + i])
                    p = alloc(s, numba.int32(0), nul)
                    if p == 0:
                        bad += 1
                    else:
                        free(p, s, numba.int32(0), nul)
            args[2] = bad
            return nul

        rng = np.random.default_rng(0)
        bufs = []
        for _ in range(2):
            sizes = rng.choice([512, 300 * 1024, 3 * MiB, 9 * MiB, 17 * MiB, 33 * MiB], size=64)
            bufs.append((C.c_int64 * (3 + len(sizes)))(len(sizes), 40, 0, *sizes.tolist()))
        libc = C.CDLL(None)
        tids = [C.c_ulong() for _ in bufs]
        for tid, buf in zip(tids, bufs):
            assert libc.pthread_create(C.byref(tid), None, C.c_void_p(body.address), buf) == 0
        for tid in tids:
            libc.pthread_join(tid, None)
        assert [b[2] for b in bufs] == [0, 0], h.last_error
        st = h.memory_stats(0)
        assert st["allocation.all.allocated"] == st["allocation.all.freed"] == 2 * 64 * 40
        assert st["allocated_bytes.all.current"] == 0
        nd = h.bridge(0)
        assert nd.allocator.counts["mapped"] > 0 and nd.allocator.counts["pages_reclaimed"] > 0  # slow paths ran
        nd.allocator._check()
    finally:
        h.close()


@pytest.mark.parametrize("options", [{}, {"aliases": True, "slack_pages": 3}, {"aliases": True, "large_unit": 64 << 10}],
                         ids=["defaults", "aliases-slack", "aliases-64k-units"])
def test_a_random_program_gets_what_the_python_allocator_gives(options, capsys):
    """The compiled entry points and the Python allocator, same options, same requests (out of
    memory included): same offsets, same driver calls, same physical memory, at every step."""
    import random

    from vmstoolkit.errors import OutOfMemoryError
    from vmstoolkit.pools.paged.allocator import SMALL_SIZE

    capacity, page = 48 * 2 * MiB, 2 * MiB
    hd = SimulatedDriver(capacity=capacity)
    h = NativeHook(lambda device: hd, **options)
    pa = make_allocator("paged", SimulatedDriver(capacity=capacity), **options)
    try:
        alloc, free = _entry_points(h)
        rng = random.Random(7)
        live, served, refused = [], 0, 0

        def offset(a, ptr, size):
            heap = a.small if size <= SMALL_SIZE else a.large
            return ptr - heap.base

        for _ in range(700):
            if rng.random() < 0.55 or not live:
                r = rng.random()
                size = (rng.randint(1, MiB) if r < 0.5 else rng.randint(MiB + 1, 6 * page) if r < 0.85
                        else rng.randint(6 * page, 20 * page))
                try:
                    pp = pa.allocate(size)
                except OutOfMemoryError:
                    pp = 0
                hp = alloc(size, 0, None) or 0
                assert (hp == 0) == (pp == 0), f"{size} bytes: hook {hp:#x}, Python {pp:#x}"
                if pp:
                    assert offset(h.bridge(0).allocator, hp, size) == offset(pa, pp, size)
                    live.append((pp, hp, size))
                    served += 1
                else:
                    refused += 1
            else:
                pp, hp, size = live.pop(rng.randrange(len(live)))
                pa.free(pp)
                free(hp, size, 0, None)
            assert dict(hd.calls) == dict(pa.driver.calls) and hd.physical_bytes == pa.driver.physical_bytes
        assert served > 300 and refused > 0  # both paths exercised, out of memory too
        h.bridge(0).allocator._check()
        pa._check()
    finally:
        pa.close()
        h.close()
    assert hd.is_empty(), hd.leak_report()
    capsys.readouterr()  # the hook reports each refusal on standard error


@pytest.mark.parametrize("name", ["paged", "vms"])
def test_the_fallbacks_warning_says_what_it_lacks(monkeypatch, capsys, name):
    """Without the shim: no catchable OOM, statistics in Python only, and for the Python
    allocators an exception unwinding past CUDA temporaries can be lost (the shim's
    KeepPythonError is what keeps it)."""
    import sys
    import types

    from vmstoolkit.integrations import torch as vt

    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: True)
    fake.Tensor = type("Tensor", (), {"record_stream": lambda self, stream: None})
    fake._C = types.SimpleNamespace(_cuda_customAllocator=lambda a, f: "allocator",
                                    _cuda_changeCurrentAllocator=lambda alloc: None)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(vt, "_INSTALLED", None)
    h = vt.install(name, shim=False)
    try:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "without the compiled shim" in err and "OutOfMemoryError" in err
        assert ("SystemError" in err) is (name != "paged")
    finally:
        if name == "paged":
            h.close()


def _same_run_both_paths(alloc, free, driver, reset_peak, reset_totals):
    """One request sequence (fast-path hits, page mapping, an OOM, a driver failure, resets) on
    either path."""
    ptrs = {}
    for i, s in enumerate([100, 3 * MiB, 5000, 64 * MiB, MiB, MiB + 1, 3 * MiB]):
        ptrs[i] = (alloc(s), s)
    free(*ptrs.pop(1))
    ptrs[7] = (alloc(3 * MiB), 3 * MiB)  # served from the freed pages (the compiled fast path)
    assert not alloc(8 * GiB)  # more than the device: out of memory
    reset_peak()
    free(*ptrs.pop(3))
    ptrs[8] = (alloc(2 * MiB), 2 * MiB)
    reset_totals()
    assert not alloc(8 * GiB)  # counted again after the reset
    driver.fail_on("create", driver.calls.get("create", 0) + 1, "CUDA_ERROR_UNKNOWN")  # a driver error is a failed malloc, not an out-of-memory
    assert not alloc(200 * MiB)
    free(*ptrs.pop(0))
    return ptrs


def test_statistics_read_the_same_whichever_path_served(hook):
    """The hook's compiled fast path, its Python slow path and the plain Python bridge over
    ``paged`` report the same figures: the hook counts through the allocator's bookkeeping."""
    from vmstoolkit.integrations.bridge import AllocatorBridge, torch_stats

    alloc, free = _entry_points(hook)
    nd = hook.bridge(0)
    _same_run_both_paths(lambda s: alloc(s, 0, None), lambda p, s: free(p, s, 0, None), nd.allocator.driver,
                         nd.reset_peak, nd.reset_accumulated)
    b = AllocatorBridge(make_allocator("paged", SimulatedDriver(capacity=4 * GiB)))
    a = b.allocator
    _same_run_both_paths(lambda s: b.malloc(s, 0, report=False), lambda p, s: b.free(p, 0), a.driver,
                         b.reset_peak, b.reset_accumulated)
    native, python = nd.allocator_stats(), a.stats()
    for field in ("allocated_bytes", "peak_allocated_bytes", "allocated_count", "peak_allocated_count",
                  "reserved_bytes", "peak_reserved_bytes", "total_allocs", "total_frees", "total_allocated_bytes",
                  "num_ooms"):
        assert getattr(native, field) == getattr(python, field), field
    assert nd.stats() == torch_stats(python) or {k for k, v in nd.stats().items() if torch_stats(python)[k] != v} \
        <= {"num_device_alloc", "num_device_free"}
    assert native.num_ooms == 1 and native.total_allocs == 0 and native.total_frees == 1
    assert nd.failed_mallocs == b.failed_mallocs == 3  # a bridge's count, which resets leave alone
    a.close()
