"""The CuPy integration's logic on the simulated driver, with a stand-in for the few CuPy names
it uses (CuPy is not needed here): allocation and release through ``UnownedMemory``'s owner,
the current stream passed through, CuPy's out-of-memory error, installing and uninstalling,
and the errors for a missing CuPy or a bad allocator name."""

import gc
import sys
from types import SimpleNamespace

import pytest

import vmstoolkit.integrations.cupy as vc
from vmstoolkit.errors import ConfigError, DriverError, NoGPUError, OutOfMemoryError, VmsError
from vmstoolkit.pools import make_driver
from vmstoolkit.units import MiB


class FakeOutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError(size, total, limit=0)``."""

    def __init__(self, size, total, limit=0):
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")
        self._size, self._total, self._limit = size, total, limit


class FakeUnownedMemory:
    """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id=-1)``; CuPy looks the device of a
    pointer up when none is given, which fails for the null pointer: require one."""

    def __init__(self, ptr, size, owner, device_id=-1):
        assert device_id >= 0, "the device id must be given"
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class FakeMemoryPointer:
    """``cupy.cuda.MemoryPointer(mem, offset)``."""

    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


def _default_allocator(nbytes):
    raise AssertionError("CuPy's own allocator was called")


def fake_cupy():
    state = SimpleNamespace(device=0, stream=0, allocator=_default_allocator)

    def set_allocator(fn=None):
        state.allocator = fn or _default_allocator

    cuda = SimpleNamespace(
        UnownedMemory=FakeUnownedMemory, MemoryPointer=FakeMemoryPointer,
        memory=SimpleNamespace(OutOfMemoryError=FakeOutOfMemoryError),
        runtime=SimpleNamespace(getDevice=lambda: state.device),
        get_current_stream=lambda: SimpleNamespace(ptr=state.stream),
        set_allocator=set_allocator, get_allocator=lambda: state.allocator, is_available=lambda: True,
    )
    return SimpleNamespace(cuda=cuda, state=state, alloc=lambda n: state.allocator(n))


@pytest.fixture
def cupy(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setattr(vc, "_import_cupy", lambda: fake)
    return fake


def sim(capacity="256MiB"):
    return lambda device: make_driver("sim", capacity=capacity)


def test_allocations_come_from_the_allocator_and_go_back_when_cupy_drops_them(cupy):
    h = vc.make_handle("vms", driver_factory=sim())
    sizes = (512, 3 * MiB, 100 * MiB)
    ptrs = [h.malloc(n) for n in sizes]
    assert all(p.ptr for p in ptrs) and len({p.ptr for p in ptrs}) == 3
    assert [p.mem.size for p in ptrs] == list(sizes) and {p.mem.device_id for p in ptrs} == {0}
    a = h.allocator()
    assert a.stats().allocated_bytes == sum(sizes)
    assert h.stats()["allocated_bytes.all.current"] == sum(sizes) == h.memory_stats(0)["allocated_bytes.all.current"]
    a._check()
    del ptrs[1]  # CuPy drops the MemoryPointer: its UnownedMemory's owner frees the block
    assert a.stats().allocated_bytes == 512 + 100 * MiB
    a._check()
    ptrs.clear()
    assert a.stats().allocated_bytes == 0 and a.stats().total_frees == 3
    assert h.bridges[0].failed_frees == 0
    a._check()


def test_an_empty_array_gets_the_null_pointer_and_builds_nothing(cupy):
    h = vc.make_handle("vms", driver_factory=sim())
    p = h.malloc(0)
    assert p.ptr == 0 and p.mem.size == 0 and p.mem.device_id == 0
    assert h.bridges == {}


def test_each_device_gets_its_own_allocator_on_first_use(cupy):
    made = []
    h = vc.make_handle("gmlake", driver_factory=lambda device: made.append(device) or make_driver("sim"))
    assert made == []
    p0 = h.malloc(4 * MiB)
    cupy.state.device = 1
    p1 = h.malloc(8 * MiB)
    p1b = h.malloc(8 * MiB)
    assert made == [0, 1] and p1.mem.device_id == 1
    assert h.stats(0)["allocated_bytes.all.current"] == 4 * MiB
    assert h.stats()["allocated_bytes.all.current"] == 16 * MiB  # the current device: 1
    del p0, p1, p1b
    for d in (0, 1):
        assert h.allocator(d).stats().allocated_bytes == 0
        h.allocator(d)._check()


def test_the_current_stream_is_passed_through_and_the_free_uses_the_allocation_stream(cupy):
    h = vc.make_handle("vms", driver_factory=sim())
    a = h.allocator(0)
    calls = []
    allocate, free = a.allocate, a.free
    a.allocate = lambda size, stream=0: calls.append(("allocate", size, stream)) or allocate(size, stream)
    a.free = lambda addr, stream=None: calls.append(("free", addr, stream)) or free(addr, stream)
    cupy.state.stream = 0x7F00
    p = h.malloc(5 * MiB)
    addr = p.ptr
    cupy.state.stream = 0x7E00  # the current stream when CuPy drops the array does not matter
    del p
    assert calls == [("allocate", 5 * MiB, 0x7F00), ("free", addr, 0x7F00)]
    # stream-ordered reuse: a second stream is in use, the freed block waits for its own stream
    cupy.state.stream = 0x7F00
    p = h.malloc(5 * MiB)
    addr = p.ptr
    cupy.state.stream = 0x7E00
    q = h.malloc(5 * MiB)
    cupy.state.stream = 0x7F00
    del p
    again = h.malloc(5 * MiB)
    assert again.ptr == addr  # reused at once by the stream that freed it
    del q, again
    a._check()


def test_a_request_it_cannot_serve_raises_cupys_out_of_memory_error(cupy):
    h = vc.make_handle("vms", driver_factory=sim("64MiB"))
    keep = h.malloc(40 * MiB)
    with pytest.raises(FakeOutOfMemoryError) as info:
        h.malloc(48 * MiB)
    e = info.value
    assert isinstance(e, MemoryError) and e._size == 48 * MiB and e._total == 40 * MiB
    assert isinstance(e.__cause__, OutOfMemoryError)
    assert any("vmstoolkit 'vms' on device 0" in n and "out of memory" in n for n in e.__notes__)
    assert h.stats()["num_ooms"] >= 1
    p = h.malloc(20 * MiB)  # the process goes on
    assert p.ptr
    del keep, p
    h.allocator()._check()


def test_memory_held_only_by_a_reference_cycle_is_collected_before_out_of_memory(cupy):
    h = vc.make_handle("vms", driver_factory=sim("64MiB"))
    gc.disable()
    try:
        cycle = [h.malloc(48 * MiB)]
        cycle.append(cycle)
        del cycle  # unreachable, but only the garbage collector frees it
        assert h.stats()["allocated_bytes.all.current"] == 48 * MiB
        p = h.malloc(48 * MiB)
    finally:
        gc.enable()
    assert p.ptr and h.stats()["allocated_bytes.all.current"] == 48 * MiB
    del p
    h.allocator()._check()


def test_other_allocator_errors_raise_as_themselves(cupy):
    h = vc.make_handle("vms", driver_factory=sim())
    d = h.allocator().driver
    d.fail_on("map", 1)  # CUDA_ERROR_UNKNOWN: a driver failure, not a full device
    with pytest.raises(DriverError, match="CUDA_ERROR_UNKNOWN") as info:
        h.malloc(4 * MiB)
    assert not isinstance(info.value, FakeOutOfMemoryError)
    assert h.malloc(4 * MiB).ptr  # the next one goes through


def test_install_and_uninstall(cupy, monkeypatch):
    monkeypatch.setattr(vc, "cuda_driver", sim())  # the real driver, simulated
    previous = cupy.cuda.get_allocator()
    h = vc.install("paged", large_unit="512KiB")
    assert cupy.cuda.get_allocator() == h.malloc and h.installed
    x = cupy.alloc(6 * MiB)  # what cupy.cuda.alloc does: the current allocator
    assert h.stats()["allocated_bytes.all.current"] == 6 * MiB
    inner = vc.make_handle("vms", driver_factory=sim()).install()
    with pytest.raises(VmsError, match="no longer CuPy's allocator"):
        h.uninstall()
    inner.uninstall()
    h.uninstall()
    assert cupy.cuda.get_allocator() is previous and not h.installed
    h.uninstall()  # twice: nothing to do
    del x  # an array made before uninstall still goes back to its allocator
    assert h.stats()["allocated_bytes.all.current"] == 0


def test_bad_name_or_option_is_a_config_error_before_anything_is_installed(cupy):
    previous = cupy.cuda.get_allocator()
    with pytest.raises(ConfigError, match="unknown allocator 'nope'"):
        vc.install("nope")
    with pytest.raises(ConfigError, match="slack_pages"):
        vc.install("paged", slack_pages="many")
    assert cupy.cuda.get_allocator() is previous


def test_missing_cupy_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(NoGPUError, match="CuPy is not installed") as info:
        vc.install("vms")
    assert "\n" not in str(info.value)


def test_no_gpu_for_cupy_is_one_clear_error(monkeypatch):
    fake = fake_cupy()
    fake.cuda.is_available = lambda: False
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(NoGPUError, match="CuPy sees no CUDA GPU"):
        vc.install("vms")
