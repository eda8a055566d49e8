"""What PyTorch sees through the handle, on the simulated driver: the shim's statistics array and
its order, the nested statistics ``torch.cuda.memory_summary`` reads, the out-of-memory message,
record_stream, and history recording read back by the loader."""

import ctypes
import re
from pathlib import Path

import pytest

from vmstoolkit.integrations.bridge import STAT_KEYS, torch_stats
from vmstoolkit.integrations.native_torch import NativeHook
from vmstoolkit.integrations.torch import TorchAllocatorHandle, nested_stats
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB, MiB


def make(name):
    if name == "paged":
        return NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB))
    return TorchAllocatorHandle(name, lambda device: SimulatedDriver(capacity=4 * GiB), {})


@pytest.fixture(params=["vms", "paged", "pytorch-caching"])
def handle(request):
    h = make(request.param)
    yield h
    if request.param == "paged":
        h.close()


def _calls(h):
    from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN

    return ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)


def test_the_shim_reads_the_statistics_in_the_order_the_python_side_writes_them():
    """The C++ enum and STAT_KEYS are one list in two languages: compare them."""
    src = (Path(__file__).parents[2] / "vmstoolkit/integrations/csrc/torch_shim.cpp").read_text()
    enum = re.search(r"enum Stat \{([^}]*)\}", src).group(1)
    names = [n.strip() for n in enum.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "N_STATS" and len(names) - 1 == len(STAT_KEYS)
    expect = ["ALLOC_CUR", "ALLOC_PEAK", "ALLOC_TOTAL", "ALLOC_FREED", "RES_CUR", "RES_PEAK", "ACTIVE_CUR",
              "ACTIVE_PEAK", "COUNT_ALLOC", "COUNT_FREED", "OOMS", "DEV_ALLOC", "DEV_FREE", "RETRIES"]
    assert names[:-1] == expect
    assert STAT_KEYS[0] == "allocated_bytes.all.current" and STAT_KEYS[4] == "reserved_bytes.all.current"


def test_statistics_through_the_shims_entry_point_equal_the_allocators(handle):
    a, f = _calls(handle)
    ptrs = [a(s, 0, None) for s in (100, 3 * MiB, 40 * MiB)]
    f(ptrs[0], 100, 0, None)
    out = (ctypes.c_int64 * len(STAT_KEYS))()
    assert handle.stats_fn(0, out, len(STAT_KEYS)) == 0
    got = dict(zip(STAT_KEYS, out))
    own = torch_stats(handle.bridge(0).allocator_stats())
    assert got == {k: own[k] for k in STAT_KEYS}
    assert got["allocated_bytes.all.current"] == 43 * MiB
    assert got["allocated_bytes.all.peak"] == 43 * MiB + 100
    assert got["allocated_bytes.all.freed"] == 100 and got["allocation.all.freed"] == 1
    assert got["reserved_bytes.all.current"] == handle.bridge(0).allocator.driver.physical_bytes
    handle.reset_fn(0, 0)  # reset_peak_memory_stats
    handle.stats_fn(0, out, len(STAT_KEYS))
    assert dict(zip(STAT_KEYS, out))["allocated_bytes.all.peak"] == 43 * MiB
    handle.reset_fn(0, 1)  # reset_accumulated_memory_stats
    handle.stats_fn(0, out, len(STAT_KEYS))
    assert dict(zip(STAT_KEYS, out))["allocation.all.allocated"] == 0
    for p, s in zip(ptrs[1:], (3 * MiB, 40 * MiB)):
        f(p, s, 0, None)
    before = handle.bridge(0).allocator.driver.physical_bytes
    handle.empty_fn()
    assert handle.bridge(0).allocator.driver.physical_bytes < before


def test_the_nested_statistics_have_everything_memory_summary_reads(handle):
    a, _ = _calls(handle)
    a(5 * MiB, 0, None)
    d = nested_stats(handle.bridge(0).stats())
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
                   "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for k in ("current", "peak", "allocated", "freed"):
                assert isinstance(d[metric][pool][k], int), (metric, pool, k)
    assert d["allocated_bytes"]["all"]["current"] == 5 * MiB
    assert d["allocation"]["all"]["current"] == 1
    for k in ("oversize_allocations", "oversize_segments"):
        assert d[k]["current"] == 0
    assert "num_ooms" in d and "num_alloc_retries" in d


def test_the_out_of_memory_message_names_the_allocators_error(handle):
    a, _ = _calls(handle)
    handle.raises = True  # as with the shim: no report on stderr, the shim raises
    assert a(8 * GiB, 0, None) is None
    buf = ctypes.create_string_buffer(2048)
    n = handle.error_fn(0, 8 * GiB, ctypes.cast(buf, ctypes.c_void_p), 2048)
    msg = buf.value.decode()
    assert n == len(msg) and "OutOfMemoryError" in msg and "8589934592" in msg
    # PyTorch's own opening, word for word: what accelerate and Lightning match
    assert msg.startswith("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 4.00 GiB of which ")


def test_record_stream_through_the_shims_entry_point_holds_the_block(handle):
    """The shim calls record(ptr, device, its stream, the user's stream) from Tensor.record_stream."""
    a, f = _calls(handle)
    s, u = 0x10, 0x20
    x = a(4 * MiB, 0, s)
    driver = handle.bridge(0).allocator.driver
    driver.enqueue_use(x, 4 * MiB, u)  # work on u reads x
    handle.record_fn(x, 0, s, u)
    f(x, 4 * MiB, 0, s)
    y = a(4 * MiB, 0, s)
    driver.enqueue_use(y, 4 * MiB, s)  # raises if y reused x's memory with no wait for u
    assert not driver.races


def test_history_recorded_under_the_handle_replays(handle, tmp_path):
    from vmstoolkit.trace.loader import load_trace
    from vmstoolkit.trace.replay import replay
    from vmstoolkit.pools import make_allocator

    a, f = _calls(handle)
    handle.record_history()
    ptrs = [(a(s, 0, None), s) for s in (512, 3 * MiB, 20 * MiB)]
    for p, s in ptrs[:2]:
        f(p, s, 0, None)
    handle.record_history(False)  # stopping keeps what was recorded
    a(MiB, 0, None)  # not recorded
    path = handle.dump_snapshot(tmp_path / "run.pickle.gz")
    t = load_trace(path)
    assert [(e.action.value, e.size) for e in t.alloc_free_events()] == [
        ("alloc", 512), ("alloc", 3 * MiB), ("alloc", 20 * MiB), ("free_completed", 512), ("free_completed", 3 * MiB)]
    r = replay(t, make_allocator("vms"))
    assert r.peak_allocated == 512 + 23 * MiB


def test_recording_puts_a_logging_adaptor_on_every_device_and_takes_it_off():
    from vmstoolkit.pools.adaptors import SnapshotLoggingAdaptor

    h = make("vms")
    a, f = _calls(h)
    f(a(MiB, 0, None), MiB, 0, None)  # device 0 made before recording
    bare = h.bridge(0).allocator
    h.record_history(max_entries=100)
    assert isinstance(h.bridge(0).allocator, SnapshotLoggingAdaptor) and h.bridge(0).allocator.upstream is bare
    assert isinstance(h.bridge(1).allocator, SnapshotLoggingAdaptor)  # made while recording
    a(2 * MiB, 1, None)
    h.record_history(False)
    assert h.bridge(0).allocator is bare and not isinstance(h.bridge(1).allocator, SnapshotLoggingAdaptor)
    snap = h.snapshot()
    assert [len(t) for t in snap["device_traces"]] == [0, 1] and snap["device_traces"][1][0]["size"] == 2 * MiB
    h.record_history(clear=True)
    snap = h.snapshot()
    assert all(t == [] for t in snap["device_traces"])  # forgotten; the live block is a segment still
    assert [(s["device"], s["total_size"]) for s in snap["segments"]] == [(1, 2 * MiB)]
