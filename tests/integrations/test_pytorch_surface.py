"""PyTorch's memory surface through the handle's entry points, on the simulated driver: CUDA graph
private pools, the memory fraction, the out-of-memory text, PyTorch's snapshot format (read back
by the loader, and by ``torch.cuda._memory_viz`` where torch is installed), and a clean exit."""

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vmstoolkit.errors import OutOfMemoryError
from vmstoolkit.integrations.abi import ALLOC_FN, FREE_FN, POOL_EVENTS
from vmstoolkit.integrations.bridge import OOM_PREFIX, pytorch_size
from vmstoolkit.integrations.native_torch import NativeHook
from vmstoolkit.integrations.torch import TorchAllocatorHandle
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB, MiB

ROOT = Path(__file__).parents[2]
USE, RELEASE, TAKE_BACK, USE_COUNT = (POOL_EVENTS.index(e) for e in ("use", "release", "take_back", "use_count"))


def make(name):
    if name == "paged":
        return NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB))
    return TorchAllocatorHandle(name, lambda device: SimulatedDriver(capacity=4 * GiB), {})


@pytest.fixture(scope="module", params=["vms", "paged"])
def shared(request):
    """One handle per allocator for the module (the compiled hook takes seconds to build)."""
    h = make(request.param)
    h.raises = True  # as with the shim: it raises, nothing on stderr
    yield h
    if request.param == "paged":
        h.close()


@pytest.fixture
def handle(shared):
    """The module's handle; each test gives back what it allocated, which is checked."""
    yield shared
    assert allocated(shared) == 0, "the test left memory allocated"
    assert not shared.recording and not shared.fractions.get(0, 1.0) < 1.0


def calls(h):
    return ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)


def allocated(h):
    return h.bridge(0).stats()["allocated_bytes.all.current"]


def message(h, size):
    buf = ctypes.create_string_buffer(4096)
    h.error_fn(0, size, ctypes.cast(buf, ctypes.c_void_p), 4096)
    return buf.value.decode()


# -- private pools ---------------------------------------------------------------------------------
def test_a_capture_pool_keeps_its_freed_memory_from_eager_allocations_until_released(handle):
    """What the shim does around a captured graph: begin (use), the capture's allocations and frees
    through the pool entry points, eager work between replays through the plain ones, release."""
    alloc, free = calls(handle)
    assert handle.pool_event_fn(0, 7, 0, USE, None, 0) == 1
    inside = handle.pool_alloc_fn(32 * MiB, 0, None, 7, 0)
    assert inside
    handle.pool_free_fn(inside, 32 * MiB, 0, None, 7, 0)  # freed during the capture
    assert allocated(handle) == 32 * MiB, "the pool keeps the block: the allocator must still count it"
    eager = alloc(32 * MiB, 0, None)
    assert eager and eager != inside, "an eager tensor must never land where a replay writes"
    again = handle.pool_alloc_fn(32 * MiB, 0, None, 7, 0)
    assert again == inside  # a later capture into the same pool reuses it
    handle.pool_free_fn(again, 32 * MiB, 0, None, 7, 0)
    assert handle.pool_event_fn(0, 7, 0, USE_COUNT, None, 0) == 1
    assert handle.pool_event_fn(0, 7, 0, RELEASE, None, 0) == 0  # the graph is reset
    assert allocated(handle) == 32 * MiB  # only the eager tensor is left
    free(eager, 32 * MiB, 0, None)
    assert allocated(handle) == 0


def test_a_shared_pool_and_checkpoint_take_back(handle):
    assert handle.pool_event_fn(0, 3, 1, USE, None, 0) == 1
    assert handle.pool_event_fn(0, 3, 1, USE, None, 0) == 2  # torch.cuda.graph(pool=...) of a second graph
    p = handle.pool_alloc_fn(MiB, 0, None, 3, 1)
    handle.pool_free_fn(p, MiB, 0, None, 3, 1)
    assert handle.pool_event_fn(0, 3, 1, TAKE_BACK, p, MiB) == 1  # setCheckpointPoolState
    assert handle.graph_pools(0).live_blocks((3, 1)) == {p: MiB}
    handle.pool_free_fn(p, MiB, 0, None, 3, 1)
    assert handle.pool_event_fn(0, 3, 1, RELEASE, None, 0) == 1
    assert handle.pool_event_fn(0, 3, 1, RELEASE, None, 0) == 0
    assert allocated(handle) == 0


def test_a_refused_pool_allocation_says_why_in_pytorchs_words(handle):
    handle.pool_event_fn(0, 5, 0, USE, None, 0)
    assert handle.pool_alloc_fn(64 * GiB, 0, None, 5, 0) is None
    msg = message(handle, 64 * GiB)
    assert msg.startswith(f"{OOM_PREFIX}64.00 GiB. GPU 0 has a total capacity of 4.00 GiB"), msg
    assert "OutOfMemoryError" in msg


# -- memory fraction -------------------------------------------------------------------------------
def test_the_memory_fraction_caps_allocations_with_a_catchable_error(handle):
    alloc, free = calls(handle)
    assert handle.get_fraction_fn(0) == 1.0
    assert handle.set_fraction_fn(0, 0.25) == 0  # torch.cuda.set_per_process_memory_fraction(0.25)
    assert handle.get_fraction_fn(0) == 0.25
    a = alloc(768 * MiB, 0, None)
    assert a
    assert alloc(512 * MiB, 0, None) is None  # 1.25 GiB > a quarter of 4 GiB
    msg = message(handle, 512 * MiB)
    assert msg.startswith(f"{OOM_PREFIX}512.00 MiB. GPU 0 has a total capacity of 4.00 GiB")
    assert "set_per_process_memory_fraction(0.25)" in msg, msg
    b = alloc(256 * MiB, 0, None)  # exactly up to the cap: fine
    assert b
    free(a, 768 * MiB, 0, None)
    c = alloc(512 * MiB, 0, None)  # room again after a free
    assert c
    assert handle.set_fraction_fn(0, 1.0) == 0  # lifted
    d = alloc(2 * GiB, 0, None)
    assert d
    for p, s in ((b, 256 * MiB), (c, 512 * MiB), (d, 2 * GiB)):
        free(p, s, 0, None)
    assert handle.set_fraction_fn(0, 1.5) == -1 and "between 0 and 1" in str(handle.last_error)


def test_the_fraction_counts_allocations_made_before_it_was_set(handle):
    alloc, free = calls(handle)
    a = alloc(900 * MiB, 0, None)
    handle.set_memory_fraction(0.25)
    assert alloc(200 * MiB, 0, None) is None  # 1.1 GiB in all
    free(a, 900 * MiB, 0, None)
    b = alloc(200 * MiB, 0, None)
    assert b
    free(b, 200 * MiB, 0, None)
    handle.set_memory_fraction(1.0)


# -- the out-of-memory text --------------------------------------------------------------------------
@pytest.mark.parametrize("size,text", [(512, "512 bytes"), (1024, "1024 bytes"), (1536, "1.50 KiB"),
                                       (MiB, "1024.00 KiB"), (3 * MiB, "3.00 MiB"), (GiB, "1024.00 MiB"),
                                       (GiB + GiB // 2, "1.50 GiB")])
def test_sizes_are_written_as_pytorchs_allocator_writes_them(size, text):
    assert pytorch_size(size) == text


def test_the_refused_request_message_begins_as_pytorchs(handle):
    alloc, _ = calls(handle)
    assert alloc(8 * GiB, 0, None) is None
    msg = message(handle, 8 * GiB)
    assert msg.startswith("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 4.00 GiB of which ")
    # what accelerate's should_reduce_batch_size and Lightning's is_oom_error look for
    assert " out of memory." in msg and "CUDA out of memory." in msg


# -- snapshots in PyTorch's format ------------------------------------------------------------------
# torch.cuda.memory._snapshot's documented keys (torch 2.11's docstring)
DOC_SEGMENT = {"address", "total_size", "stream", "segment_type", "allocated_size", "active_size", "blocks"}
DOC_BLOCK = {"size", "requested_size", "address", "state", "frames"}
DOC_FRAME = {"filename", "line", "name"}
DOC_TRACE = {"action", "addr", "frames", "size", "stream"}


def allocate_in_user_code(alloc, n):
    return [alloc(s, 0, None) for s in (MiB, 5 * MiB, 700)[:n]]


def test_pytorchs_snapshot_from_the_handle_has_the_documented_keys_and_the_users_frames(handle, tmp_path):
    alloc, free = calls(handle)
    handle.record_history(True, max_entries=100, stacks="python", keep="last", clear=True)
    ptrs = allocate_in_user_code(alloc, 3)
    free(ptrs[0], MiB, 0, None)
    snap = handle.snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    trace = snap["device_traces"][0]
    assert [e["action"] for e in trace] == ["alloc", "alloc", "alloc", "free_completed"]
    for e in trace:
        assert set(e) >= DOC_TRACE
        assert all(set(f) == DOC_FRAME for f in e["frames"])
    names = [f["name"] for f in trace[0]["frames"]]
    assert "allocate_in_user_code" in names and not any("vmstoolkit/integrations" in f["filename"]
                                                        for f in trace[0]["frames"])
    if handle.runs_python:  # the compiled hook's live blocks are known to the shim only
        assert sorted(s["address"] for s in snap["segments"]) == sorted(ptrs[1:])
    for seg in snap["segments"]:
        assert set(seg) >= DOC_SEGMENT
        for b in seg["blocks"]:
            assert set(b) >= DOC_BLOCK and b["state"] == "active_allocated"
    path = handle.dump_snapshot(tmp_path / "run.pickle.gz")
    from vmstoolkit.trace.loader import load_trace

    t = load_trace(path)
    assert len(t.alloc_free_events()) == 4
    handle.record_history(False)
    for p, s in zip(ptrs[1:], (5 * MiB, 700)):
        free(p, s, 0, None)


def test_max_entries_keeps_the_latest_as_pytorchs_ring_does(handle):
    alloc, free = calls(handle)
    handle.record_history(True, max_entries=3, keep="last", clear=True)
    for _ in range(4):
        p = alloc(MiB, 0, None)
        free(p, MiB, 0, None)
    trace = handle.snapshot()["device_traces"][0]
    assert [e["action"] for e in trace] == ["free_completed", "alloc", "free_completed"]
    assert handle.history.dropped == 5
    handle.record_history(False)


def test_memory_viz_reads_the_snapshot(handle):
    viz = pytest.importorskip("torch.cuda._memory_viz")
    alloc, free = calls(handle)
    handle.record_history(True, stacks="python", keep="last", clear=True)
    ptrs = allocate_in_user_code(alloc, 3)
    free(ptrs[2], 700, 0, None)
    try:
        snap = handle.snapshot()
        snap["device_traces"][0] = snap["device_traces"][0][1:]  # from the second event on
        text = viz.trace(snap)
        assert "3 entries" in text and "free completed" in text, text
        assert "Summary of segments" in viz.segsum(snap)
        lines = lambda flamegraph_lines: flamegraph_lines  # noqa: E731 (no flamegraph.pl download)
        segs, mem = viz.segments(snap, format_flamegraph=lines), viz.memory(snap, format_flamegraph=lines)
        if handle.runs_python:  # live blocks known without the shim: segments, with the user's frames
            assert "= seg_" in text and "allocate_in_user_code" in segs and "active_allocated" in mem
        assert "<html" in viz.trace_plot(snap).lower()
        assert "<html" in viz.segment_plot(snap).lower()
    finally:
        handle.record_history(False)
        for p, s in zip(ptrs[:2], (MiB, 5 * MiB)):
            free(p, s, 0, None)


# -- exit -----------------------------------------------------------------------------------------
PROGRAM = """
import threading
from vmstoolkit.integrations.abi import ALLOC_FN, FREE_FN
from vmstoolkit.integrations.native_torch import NativeHook
from vmstoolkit.integrations.torch import TorchAllocatorHandle
from vmstoolkit.pools.drivers.sim import SimulatedDriver

handles = [NativeHook(lambda d: SimulatedDriver(capacity=1 << 30)),
           TorchAllocatorHandle("vms", lambda d: SimulatedDriver(capacity=1 << 30), {})]
for h in handles:
    h.raises = True
    alloc, free = ALLOC_FN(h.alloc_ptr), FREE_FN(h.free_ptr)
    kept = [alloc(1 << 20, 0, None) for _ in range(4)]  # left live at exit
    assert alloc(1 << 40, 0, None) is None               # a refused request
    h.pool_event_fn(0, 1, 0, 0, None, 0)
    graph = h.pool_alloc_fn(1 << 20, 0, None, 1, 0)      # a pool never released
    t = threading.Thread(target=lambda: [free(alloc(4096, 0, None), 4096, 0, None) for _ in range(50)])
    t.start(); t.join()
print("done")
"""


def test_a_program_that_leaves_blocks_pools_and_an_oom_behind_exits_with_status_0():
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(PROGRAM)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "done"


def test_limit_errors_are_the_allocators_out_of_memory_error(handle):
    handle.set_memory_fraction(0.001)
    alloc, _ = calls(handle)
    assert alloc(64 * MiB, 0, None) is None
    err = handle._pending_error or handle.bridge(0).last_error or handle.last_error
    assert isinstance(err, OutOfMemoryError)
    handle.set_memory_fraction(1.0)


def test_the_shims_pool_events_and_entry_points_are_the_python_sides():
    """The C++ enum PoolEvent and struct EntryPoints against abi.POOL_EVENTS and shim_pointers."""
    import re

    src = (ROOT / "vmstoolkit/integrations/csrc/torch_shim.cpp").read_text()
    enum = re.search(r"enum PoolEvent \{([^}]*)\}", src).group(1)
    names = [n.split("=")[0].strip() for n in enum.split(",") if n.strip()]
    assert names == [f"POOL_{e.upper()}" for e in POOL_EVENTS]
    fields = re.search(r"struct EntryPoints \{([^}]*)\}", src).group(1)
    assert len([ln for ln in fields.splitlines() if ln.strip().endswith(";")]) == 12
    h = make("vms")
    assert len(h.shim_pointers) == 12 and len(set(h.shim_pointers)) == 12
