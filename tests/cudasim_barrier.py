"""The Numba CUDA simulator's thread blocks, without its busy-waiting scheduler (tests only).

The simulator (``numba.cuda.simulator.kernel``) runs each CUDA thread of a block as a Python
thread, and its ``BlockManager.run`` polls them in a loop (``is_alive``, ``syncthreads_blocked``)
until all are blocked in ``syncthreads()`` or done. That loop holds the GIL whenever it gets it,
for a whole switch interval while the kernel's threads wait for it: measured on the kernel tests,
about half of their CPU time. :func:`install` replaces the poll by a condition variable that a
thread notifies when it enters ``syncthreads()`` and when it ends; everything else is the
simulator's own: the same threads, the same barrier rule (all live threads of the block blocked:
all released at once), exceptions raised the same way (the other threads aborted), the same
``syncthreads_count/and/or``. Without the expected simulator internals (another numba-cuda)
nothing is replaced and the stock scheduler runs.
"""

from __future__ import annotations

import threading

import numpy as np

_SYNC_ABORT = "abort flag set on syncthreads call"
_CLEAR_ABORT = "abort flag set on syncthreads clear"


def install() -> bool:
    """Replace the scheduler; True if it was (idempotent)."""
    try:
        from numba.cuda.simulator import kernel as K
    except ImportError:
        return False
    bt, bm = getattr(K, "BlockThread", None), getattr(K, "BlockManager", None)
    if bt is None or bm is None or not hasattr(bt, "syncthreads") or not hasattr(bm, "run"):
        return False
    if getattr(bm, "_vmstoolkit_barrier", False):
        return True

    stock_thread_run = bt.run

    def thread_run(self):
        try:
            stock_thread_run(self)  # records the kernel's exception in self.exception
        finally:
            with self._manager._cond:
                self._finished = True
                self._manager._cond.notify()

    def syncthreads(self):
        if self.abort:
            raise RuntimeError(_SYNC_ABORT)
        with self._manager._cond:
            self.syncthreads_blocked = True
            self._manager._cond.notify()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError(_CLEAR_ABORT)

    def run(self, grid_point, *args):
        self._cond = cond = threading.Condition()
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)

            t = K.BlockThread(target, self, grid_point, block_point, self._debug)
            t._finished = False
            threads.append(t)
        for t in threads:
            t.start()
        with cond:
            while True:
                failed = next((t for t in threads if t.exception), None)
                if failed is not None:
                    for other in threads:  # as the stock scheduler: abort the others, do not join
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise failed.exception[0].with_traceback(failed.exception[1])
                live = [t for t in threads if not t._finished]
                if not live:
                    break
                if all(t.syncthreads_blocked for t in live):
                    for t in live:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                cond.wait()
        for t in threads:
            t.join()

    bt.run, bt.syncthreads, bm.run = thread_run, syncthreads, run
    bm._vmstoolkit_barrier = True
    return True
