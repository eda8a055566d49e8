"""The real driver binds its context on threads that have none (PyTorch's autograd threads):
:class:`~vmstoolkit.pools.drivers.cuda.ContextBinding` against a fake ``cu`` that keeps a
per-thread context stack the way the CUDA driver does."""

import threading

import pytest

from vmstoolkit.errors import DriverError
from vmstoolkit.pools.drivers.cuda import ContextBinding


class FakeCu:
    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_CONTEXT = 201

    def __init__(self):
        self.tls = threading.local()
        self.calls = []

    def _stack(self):
        if not hasattr(self.tls, "stack"):
            self.tls.stack = []
        return self.tls.stack

    def cuCtxGetCurrent(self):
        self.calls.append("get")
        s = self._stack()
        return 0, (s[-1] if s else 0)

    def cuCtxPushCurrent(self, ctx):
        self.calls.append("push")
        self._stack().append(ctx)
        return (0,)

    def cuCtxPopCurrent(self):
        self.calls.append("pop")
        return 0, self._stack().pop()

    def cuCtxSynchronize(self):  # context-bound, like the real one
        s = self._stack()
        return (0 if s and s[-1] == 0xC0 else self.CUresult.CUDA_ERROR_INVALID_CONTEXT,)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_INVALID_CONTEXT" if err == 201 else b"CUDA_ERROR_UNKNOWN"


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def test_a_thread_without_context_gets_it_for_the_call_and_loses_it_after():
    cu, ctx = FakeCu(), 0xC0
    binding = ContextBinding(cu, ctx)

    def work():
        assert cu.cuCtxSynchronize() == (201,)  # what the H200 said from autograd's thread
        with binding:
            with binding:  # nested: nothing checked again
                got = cu.cuCtxSynchronize()
        return got, cu.cuCtxGetCurrent()[1]

    assert _in_thread(work) == ((0,), 0)  # worked inside; the thread is as it was after
    assert cu.calls.count("push") == cu.calls.count("pop") == 1


def test_a_thread_on_another_context_gets_it_back():
    cu = FakeCu()
    binding = ContextBinding(cu, 0xC0)

    def work():
        cu.cuCtxPushCurrent(0xD1)  # the thread works on another device
        with binding:
            inside = cu.cuCtxGetCurrent()[1]
        return inside, cu.cuCtxGetCurrent()[1]

    assert _in_thread(work) == (0xC0, 0xD1)


def test_a_thread_already_on_the_context_pushes_nothing():
    cu = FakeCu()
    binding = ContextBinding(cu, 0xC0)
    cu.cuCtxPushCurrent(0xC0)
    cu.calls.clear()
    with binding:
        assert cu.cuCtxSynchronize() == (0,)
    assert cu.calls == ["get"]


def test_an_error_inside_still_pops():
    cu = FakeCu()
    binding = ContextBinding(cu, 0xC0)

    def work():
        with pytest.raises(DriverError):
            with binding:
                raise DriverError("CUDA_ERROR_UNKNOWN", "cuMemMap", code=999)
        return cu.cuCtxGetCurrent()[1]

    assert _in_thread(work) == 0
