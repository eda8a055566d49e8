import asyncio
import ctypes
import threading

import pytest

from vmstoolkit.exec.backends.host_callbacks import HOST_FN, HostCallbacks, raw_stream


def test_futures_resolve_on_the_loop_when_another_thread_calls_the_host_function():
    """The driver calls the host function from its own thread, in stream order: simulate that
    with a thread calling the C function pointer for each enqueued key, in order."""

    async def main():
        loop = asyncio.get_running_loop()
        queued = []
        cb = HostCallbacks(loop, enqueue=lambda stream, fn, key: queued.append((stream, fn, key)))
        futs = [cb.after(stream="s0") for _ in range(5)]
        assert cb.pending() == 5 and not any(f.done() for f in futs)
        fn = HOST_FN(queued[0][1])
        t = threading.Thread(target=lambda: [fn(ctypes.c_void_p(key)) for _, _, key in queued])
        t.start()
        await asyncio.wait_for(asyncio.gather(*futs), timeout=5)
        t.join()
        assert cb.pending() == 0 and not cb.errors
        assert len(cb.pins.pinned) == 1 and threading.get_ident() not in cb.pins.pinned
        assert {k for _, _, k in queued} == set(range(1, 6))  # never 0 (a NULL userData)

    asyncio.run(main())


def test_a_failed_enqueue_leaves_no_pending_future():
    async def main():
        def fail(stream, fn, key):
            raise RuntimeError("CUDA_ERROR_INVALID_HANDLE: cuLaunchHostFunc")

        cb = HostCallbacks(asyncio.get_running_loop(), enqueue=fail)
        with pytest.raises(RuntimeError, match="INVALID_HANDLE"):
            cb.after(stream="s0")
        assert cb.pending() == 0

    asyncio.run(main())


def test_an_unknown_key_is_recorded_not_raised_into_the_driver():
    async def main():
        cb = HostCallbacks(asyncio.get_running_loop(), enqueue=lambda *a: None)
        HOST_FN(cb.fn_address)(ctypes.c_void_p(12345))
        assert len(cb.errors) == 1 and isinstance(cb.errors[0], KeyError)

    asyncio.run(main())


class _Stream:
    def __init__(self, handle):
        self.handle = handle


class _CUstreamLike:  # cuda-bindings' CUstream: int() works, no .value
    def __int__(self):
        return 0x1234


def test_raw_stream_reads_both_bindings():
    assert raw_stream(_Stream(ctypes.c_void_p(0x5678))) == 0x5678
    assert raw_stream(_Stream(_CUstreamLike())) == 0x1234
    assert raw_stream(0) == 0 and raw_stream(None) == 0  # the default stream, as launchers pass it
