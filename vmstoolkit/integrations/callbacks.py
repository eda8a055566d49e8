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


from vmstoolkit._thread_states import ThreadStatePins  # noqa: F401 (moved below exec/ and integrations/; re-exported)
from vmstoolkit.integrations.testing import roundtrips_from_native_thread  # noqa: F401 (its old home)
