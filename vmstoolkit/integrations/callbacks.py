"""Python callbacks called from threads Python did not start, made cheap.

A framework calls our ``ctypes`` callbacks from its own native threads: PyTorch's autograd
engine runs the backward pass (and so about half of all allocations and frees) on a device
thread of its own. For such a thread ``ctypes`` calls ``PyGILState_Ensure`` on entry, which
finds no Python thread state, *creates* one, and destroys it again on exit: every callback pays
for a thread state's birth and death, many times what the call itself costs from a Python
thread. ``benchmarks/callback_overhead.py`` measures it, and what the pins below save
(``docs/results.md#callback-overhead``).

:class:`ThreadStatePins` keeps one extra ``PyGILState_Ensure`` per native thread that calls in
(never released), so the thread keeps its state for its lifetime and later entries only take
the GIL: the same trick pybind11 plays for threads that call into Python repeatedly. The cost is
one Python thread state (a few hundred bytes) per such thread, held until the thread ends;
framework threads live as long as the process.
"""

from __future__ import annotations

import ctypes
import threading

from vmstoolkit.integrations.testing import roundtrips_from_native_thread  # noqa: F401 (its old home)

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
