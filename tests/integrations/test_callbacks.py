import threading

from vmstoolkit.integrations.callbacks import ThreadStatePins
from vmstoolkit.integrations.testing import roundtrips_from_native_thread
from vmstoolkit.integrations.torch import make_handle
from vmstoolkit.pools import make_driver
from vmstoolkit.units import MiB


def _sim_handle():
    return make_handle("vms", driver_factory=lambda device: make_driver("sim"))


def test_callbacks_from_a_native_thread_are_served_and_pin_that_thread():
    h = _sim_handle()
    ok, _ = roundtrips_from_native_thread(h.alloc_ptr, h.free_ptr, 4 * MiB, 50)
    assert ok == 50
    # the native thread is pinned once; this (Python) thread never called in
    assert len(h.threads.pinned) == 1 and threading.get_ident() not in h.threads.pinned
    s = h.memory_stats()
    assert s["allocation.all.allocated"] == 50 and s["allocation.all.freed"] == 50
    assert s["allocated_bytes.all.current"] == 0
    h.bridge(0).allocator._check()


def test_each_native_thread_is_pinned_once():
    h = _sim_handle()
    for _ in range(3):
        roundtrips_from_native_thread(h.alloc_ptr, h.free_ptr, 1000, 5)
    # three threads one after the other: the ident may be reused, never more than three entries
    assert 1 <= len(h.threads.pinned) <= 3


def test_pin_from_a_python_thread_is_recorded_once():
    pins = ThreadStatePins()
    pins.pin()
    pins.pin()
    assert pins.pinned == {threading.get_ident()}
