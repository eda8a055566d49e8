"""The Numba CUDA simulator's thread blocks, without its busy-waiting scheduler and without a new
OS thread per CUDA thread per block (tests only).

The simulator (``numba.cuda.simulator.kernel``) runs each CUDA thread of a block as a Python
thread, and its ``BlockManager.run`` polls them in a loop (``is_alive``, ``syncthreads_blocked``)
until all are blocked in ``syncthreads()`` or done. That loop holds the GIL whenever it gets it,
for a whole switch interval while the kernel's threads wait for it: measured on the kernel tests,
about half of their CPU time. It also starts a fresh ``threading.Thread`` for every thread of
every block (about 80 us of CPU each, much of it in the kernel: a 4-block launch of 128 threads
paid 40 ms before running a line of the kernel).

:func:`install` replaces both. The threads of a block shape are started once and kept (a few
pools, the last used ones): each runs the blocks of a launch one after another, as the stock
manager runs them, one block at a time, its ``blockIdx`` set for each. The barrier is a count
under a lock: the thread that makes every live thread of the block blocked (by entering
``syncthreads()`` or by ending) releases them all, the stock rule (woken one after another, each
waking the next, rather than all at once into a fight for the GIL: on the bf16 kernels'
barrier-heavy warp exchanges that fight was most of their system CPU time). A thread's exception
is raised the stock way (named ``tid=[...] ctaid=[...]``, with its traceback), the other threads
of the block aborted and not joined; that pool is then retired. Everything else is the
simulator's own: the same ``BlockThread`` class (``threadIdx``, ``thread_id``,
``syncthreads_count/and/or``), the same per-launch ``FakeCUDAModule``. Without the expected
simulator internals nothing is replaced and the stock scheduler runs.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np

_SYNC_ABORT = "abort flag set on syncthreads call"
_CLEAR_ABORT = "abort flag set on syncthreads clear"
_POOLS_KEPT = 6  # block shapes whose threads are kept between launches


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
    Dim3 = K.Dim3
    allocate_lock = threading.Lock
    pools: OrderedDict[tuple, list] = OrderedDict()

    class PooledThread(bt):
        """One CUDA thread index of a block shape, running block after block."""

        def __init__(self, manager, threadIdx):
            super().__init__(None, manager, (0, 0, 0), threadIdx, False)
            self._gate = allocate_lock()  # held: released by the manager to start a block
            self._gate.acquire()
            self._bar = allocate_lock()  # held: released to let the thread past a barrier
            self._bar.acquire()
            self._job = None
            self._next = None  # the thread this one wakes after a barrier, if any
            self._retire = False

        def run(self):
            while True:
                self._gate.acquire()
                job = self._job
                if job is None:
                    return
                m, args = job
                self._job = None
                try:
                    if m._debug:
                        with np.errstate(divide="raise"):
                            m._f(*args)
                    else:
                        m._f(*args)
                except Exception as e:  # the stock BlockThread.run's record of it
                    tid = "tid=%s" % list(self.threadIdx)
                    ctaid = "ctaid=%s" % list(self.blockIdx)
                    msg = "%s %s" % (tid, ctaid) if str(e) == "" else "%s %s: %s" % (tid, ctaid, e)
                    self.exception = (type(e)(msg), sys.exc_info()[2])
                except BaseException:  # the thread dies (as a stock one would): its pool is not reused
                    m._broken = True
                    raise
                finally:
                    m._thread_done(self)
                if self._retire:
                    return

        def syncthreads(self):
            if self.abort:
                raise RuntimeError(_SYNC_ABORT)
            m = self._manager
            with m._lock:
                if m._aborted:
                    raise RuntimeError(_SYNC_ABORT)
                m._blocked.append(self)
                self.syncthreads_blocked = True
                release = m._take_blocked_if_all()
            if release is not None:
                release._bar.release()
            self._bar.acquire()
            nxt = self._next
            if nxt is not None:  # wake the next thread of the released chain
                self._next = None
                nxt._bar.release()
            if self.abort:
                raise RuntimeError(_CLEAR_ABORT)

    def take_blocked_if_all(self):
        """Under ``_lock``: if the blocked threads are all the live ones, take them, chained: the
        first of the chain is returned, to be woken, and each one woken wakes the next (one thread
        waking at a time, not a block's worth at once contending for the GIL)."""
        if self._blocked and len(self._blocked) == self._live:
            release, self._blocked = self._blocked, []
            for t in release:
                t.syncthreads_blocked = False
            for a, b in zip(release, release[1:]):
                a._next = b
            release[-1]._next = None
            return release[0]
        return None

    def thread_done(self, t):
        wake = False
        with self._lock:
            self._live -= 1
            if t.exception is not None and self._failed is None:
                self._failed = t
            if not self._woken and (self._failed is not None or self._live == 0):
                self._woken = wake = True
                release = None
            else:
                release = self._take_blocked_if_all()
        if wake:
            self._done.release()
        elif release is not None:
            release._bar.release()

    def pool_for(manager):
        key = tuple(manager._block_dim)
        pool = pools.pop(key, None)
        if pool is None:
            pool = [PooledThread(manager, p) for p in np.ndindex(*key)]
            for t in pool:
                t.start()
        pools[key] = pool  # the most recently used last
        while len(pools) > _POOLS_KEPT:
            _, old = pools.popitem(last=False)
            for t in old:
                t._job = None
                t._gate.release()  # its loop ends
        return key, pool

    def run(self, grid_point, *args):
        key, pool = pool_for(self)
        self._lock = allocate_lock()
        self._done = allocate_lock()
        self._done.acquire()
        self._live, self._blocked, self._failed, self._woken, self._aborted = len(pool), [], None, False, False
        self._broken = False
        block_idx = Dim3(*grid_point)
        for t in pool:
            t._manager, t.blockIdx = self, block_idx
            t.exception, t.abort, t.syncthreads_blocked = None, False, False
            t._job = (self, args)
        for t in pool:
            t._gate.release()
        self._done.acquire()  # the last thread ended, or one failed
        failed = self._failed
        if self._broken and pools.get(key) is pool:
            del pools[key]
        if failed is not None:
            # as the stock scheduler: abort the others, do not join; this pool is not reused
            if pools.get(key) is pool:
                del pools[key]
            with self._lock:
                self._aborted = True
                blocked, self._blocked = self._blocked, []
                for other in pool:
                    other._retire = True
                    other.abort = True
                    other.syncthreads_blocked = False
            for other in blocked:
                other._bar.release()
            for other in pool:  # one already back at its gate leaves; the others leave after the block
                try:
                    other._gate.release()
                except RuntimeError:  # not taken its job yet: it runs it (aborted), then leaves
                    pass
            raise failed.exception[0].with_traceback(failed.exception[1])

    bm.run, bm._thread_done, bm._take_blocked_if_all = run, thread_done, take_blocked_if_all
    bm._vmstoolkit_barrier = True
    bm._vmstoolkit_pools = pools
    return True
