"""The CUDA backend's driver-level events and copies (exec/backends/driver_events.py) against a
recording stand-in of cuda-bindings' driver: the calls, their arguments, the one-line errors,
and every event destroyed at close in its GPU's turn. (The GPU itself is not here: the module is
opt-in until a GPU run has checked it.)"""

import types

import numpy as np
import pytest

from vmstoolkit.exec.backends import driver_events as DE
from vmstoolkit.exec.errors import CudaCallError, InvalidOptionError, InvalidShapeError

driver = pytest.importorskip("cuda.bindings.driver")
R = driver.CUresult


class FakeDriver(types.SimpleNamespace):
    def __init__(self):
        super().__init__(CUresult=R, CUevent_flags=driver.CUevent_flags, calls=[], ready=set(), fail=None, n=0)

    def _ret(self, name, *args):
        self.calls.append((name, *args))
        return (R.CUDA_ERROR_INVALID_VALUE,) if self.fail == name else (R.CUDA_SUCCESS,)

    def cuEventCreate(self, flags):
        self.n += 1
        self.calls.append(("cuEventCreate", flags))
        return R.CUDA_SUCCESS, f"ev{self.n}"

    def cuEventRecord(self, ev, stream):
        return self._ret("cuEventRecord", ev, stream)

    def cuStreamWaitEvent(self, stream, ev, flags):
        return self._ret("cuStreamWaitEvent", stream, ev, flags)

    def cuEventQuery(self, ev):
        self.calls.append(("cuEventQuery", ev))
        if self.fail == "cuEventQuery":
            return (R.CUDA_ERROR_ILLEGAL_ADDRESS,)
        return (R.CUDA_SUCCESS,) if ev in self.ready else (R.CUDA_ERROR_NOT_READY,)

    def cuEventDestroy(self, ev):
        return self._ret("cuEventDestroy", ev)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._ret("HtoD", dst, src, n, stream)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._ret("DtoH", dst, src, n, stream)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        return self._ret("DtoD", dst, src, n, stream)


@pytest.fixture
def fake(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(DE, "_driver", lambda: d)
    return d


class View:
    """What copy_async reads of a Numba device view."""

    def __init__(self, address, nbytes):
        self.device_ctypes_pointer = types.SimpleNamespace(value=address)
        self.nbytes = nbytes


def test_events_record_wait_query_and_are_destroyed_per_gpu(fake):
    evs = DE.DriverEvents()
    a, b = evs.new(0), evs.new(1)
    assert fake.calls[0] == ("cuEventCreate", driver.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
    a.record(0x10)
    b.wait(0x20)
    assert ("cuEventRecord", "ev1", 0x10) in fake.calls and ("cuStreamWaitEvent", 0x20, "ev2", 0) in fake.calls
    assert a.query() is False
    fake.ready.add("ev1")
    assert a.query() is True
    assert len(evs) == 2
    evs.close(0)
    assert [c for c in fake.calls if c[0] == "cuEventDestroy"] == [("cuEventDestroy", "ev1")]
    evs.close(1)
    evs.close(1)  # twice: nothing more
    assert [c[1] for c in fake.calls if c[0] == "cuEventDestroy"] == ["ev1", "ev2"] and len(evs) == 0


def test_a_failed_call_is_one_line_naming_it(fake):
    ev = DE.DriverEvents().new()
    fake.fail = "cuEventRecord"
    with pytest.raises(CudaCallError, match="cuEventRecord"):
        ev.record(0)
    fake.fail = "cuEventQuery"
    with pytest.raises(CudaCallError, match="cuEventQuery"):
        ev.query()


def test_copies_go_the_right_way_with_the_right_sizes(fake):
    host = np.zeros(256, np.float32)
    dev, other = View(0xA000, 1024), View(0xB000, 1024)
    DE.copy_async("h2d", dev, host, 7)
    DE.copy_async("d2h", dev, host, 7)
    DE.copy_async("d2d", dev, other, 7)
    assert fake.calls == [("HtoD", 0xA000, host.ctypes.data, 1024, 7), ("DtoH", host.ctypes.data, 0xA000, 1024, 7),
                          ("DtoD", 0xA000, 0xB000, 1024, 7)]


def test_a_copy_that_does_not_fit_is_refused_before_the_driver(fake):
    with pytest.raises(InvalidShapeError, match="1024 bytes on the device, 2048"):
        DE.copy_async("h2d", View(0xA000, 1024), np.zeros(512, np.float32), 0)
    with pytest.raises(InvalidShapeError, match="not contiguous"):
        DE.copy_async("d2h", View(0xA000, 512), np.zeros((16, 16), np.float32)[:, ::2], 0)
    with pytest.raises(InvalidOptionError, match="copy kind"):
        DE.copy_async("sideways", View(0xA000, 16), np.zeros(4, np.float32), 0)
    assert fake.calls == []
    fake.fail = "HtoD"
    with pytest.raises(CudaCallError, match="h2d of 16 bytes"):
        DE.copy_async("h2d", View(0xA000, 16), np.zeros(4, np.float32), 0)


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(DE.ENV, raising=False)
    assert not DE.enabled()
    monkeypatch.setenv(DE.ENV, "1")
    assert DE.enabled()
