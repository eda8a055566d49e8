"""Completions delivered by the GPU itself: a host function enqueued after a vertex's work.

``cuLaunchHostFunc`` (through cuda-bindings) runs a C function on a thread of the CUDA driver
once everything before it in the stream is done. Here that function is one ``ctypes`` callback
shared by every completion: ``userData`` carries a key, the callback resolves the key's future
on the asyncio loop with ``loop.call_soon_threadsafe``. The driver's thread is not a Python
thread, so its Python thread state is pinned once (:mod:`vmstoolkit._thread_states`)
instead of being created and destroyed on every completion.

The host function also holds back the work queued behind it in the same stream until it has
run: the cost per vertex is a GIL hand-off, which is why the backend measures this against
polling events (``notify="poll"``) rather than assuming either.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import threading

from vmstoolkit._cuda_handles import raw_stream  # noqa: F401 - also this module's name for it
from vmstoolkit._thread_states import ThreadStatePins
from vmstoolkit.exec.errors import CudaCallError

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void CUDA_CB fn(void* userData)


class HostCallbacks:
    """Futures resolved on ``loop`` by host functions enqueued with :meth:`after`.

    ``enqueue(stream, fn_address, key)`` is the driver call (``cuLaunchHostFunc`` by default);
    tests pass their own to run the callback from a thread of their choosing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, enqueue=None) -> None:
        self.loop = loop
        self.pins = ThreadStatePins()
        self._futures: dict[int, asyncio.Future] = {}
        self._keys = itertools.count(1)  # 0 would travel as a NULL userData
        self._lock = threading.Lock()
        self._fn = HOST_FN(self._called)  # kept alive as long as self: the driver holds only the address
        self.fn_address = ctypes.cast(self._fn, ctypes.c_void_p).value
        self._enqueue = enqueue or _cu_launch_host_func
        self.errors: list[BaseException] = []

    def after(self, stream) -> asyncio.Future:
        """A future that resolves once the work enqueued on ``stream`` so far is done."""
        key = next(self._keys)
        fut = self.loop.create_future()
        with self._lock:
            self._futures[key] = fut
        try:
            self._enqueue(stream, self.fn_address, key)
        except BaseException:
            with self._lock:
                del self._futures[key]
            raise
        return fut

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def _called(self, user_data) -> None:
        try:
            self.pins.pin()
            with self._lock:
                fut = self._futures.pop(user_data or 0)
            self.loop.call_soon_threadsafe(_resolve, fut)
        except BaseException as e:  # never into the driver's thread
            self.errors.append(e)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _cu_launch_host_func(stream, fn_address: int, key: int) -> None:
    from cuda.bindings import driver as cu

    (err,) = cu.cuLaunchHostFunc(raw_stream(stream), cu.CUhostFn(fn_address), key)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaCallError(err.name, f"cuLaunchHostFunc on stream {raw_stream(stream):#x}")
