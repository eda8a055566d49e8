"""Python thread states kept for native threads that call into Python repeatedly.

A ``ctypes`` callback entered from a thread Python did not start (PyTorch's autograd device
threads, the CUDA driver's callback thread) calls ``PyGILState_Ensure``, which finds no Python
thread state, *creates* one, and destroys it again on exit: every call pays for a thread state's
birth and death (12-13 us per call against 0.3 us from a Python thread on the 2-core CPU machine,
``benchmarks/callback_overhead.py``).

:class:`ThreadStatePins` keeps one extra ``PyGILState_Ensure`` per native thread that calls in
(never released), so the thread keeps its state for its lifetime and later entries only take the
GIL: the same trick pybind11 plays for threads that call into Python repeatedly. The cost is one
Python thread state (a few hundred bytes) per such thread, held until the thread ends; framework
and driver threads live as long as the process.

It sits below both of its users: the runtime's host callbacks (``exec/backends``) and the
framework integrations (``integrations/``, which re-export it from ``integrations.callbacks``).
"""

from __future__ import annotations

import ctypes
import threading

_ensure = ctypes.pythonapi.PyGILState_Ensure
_ensure.restype = ctypes.c_int
_ensure.argtypes = []


class ThreadStatePins:
    """Keeps the Python thread state of every thread that calls :meth:`pin`.

    Call :meth:`pin` first thing in a callback. Threads Python started already keep their state;
    for them the pin only raises a counter, harmlessly.
    """

    def __init__(self) -> None:
        self.pinned: set[int] = set()  # thread idents (an ident may be reused after a thread ends)

    def pin(self) -> None:
        """Runtime cost: one set lookup once the thread is pinned."""
        ident = threading.get_ident()
        if ident not in self.pinned:
            _ensure()  # never released: this thread's state now outlives the callback
            self.pinned.add(ident)
