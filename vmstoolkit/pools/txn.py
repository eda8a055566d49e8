"""A small transaction for multi-step driver sequences (create, reserve, map, set access).

Each step registers its undo right after it succeeds; leaving the ``with`` block without
``commit()`` (an exception) runs the undos in reverse order, so a failure in the middle leaves
nothing created, reserved or mapped. An undo that itself fails is reported on the original
error as a note, never hidden.

>>> log = []
>>> try:
...     with Transaction() as tx:
...         tx.on_rollback(lambda: log.append("undo a"))
...         tx.on_rollback(lambda: log.append("undo b"))
...         raise RuntimeError("step c failed")
... except RuntimeError:
...     pass
>>> log
['undo b', 'undo a']
"""

from __future__ import annotations

from typing import Callable


class Transaction:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._committed = False

    def on_rollback(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def commit(self) -> None:
        self._committed = True
        self._undo.clear()

    def rollback(self) -> list[BaseException]:
        errors = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # keep undoing: report, never hide
                errors.append(e)
        return errors

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not self._committed:
            for err in self.rollback():
                exc.add_note(f"rollback step failed too: {type(err).__name__}: {err}")
        elif not self._committed:
            self.commit()
        return False


def map_new_range(driver, size: int) -> tuple[int, int]:
    """``(va, handle)`` of ``size`` fresh bytes: create, reserve, map, set access, all or nothing."""
    with Transaction() as tx:
        h = driver.create(size)
        tx.on_rollback(lambda: driver.release(h))
        va = driver.reserve(size)
        tx.on_rollback(lambda: driver.free_address(va, size))
        driver.map(va, size, h)
        tx.on_rollback(lambda: driver.unmap(va, size))
        driver.set_access(va, size)
        tx.commit()
    return va, h


def unmap_range_steps(va: int, size: int, handle: int) -> list[tuple[str, int, int]]:
    """The teardown of :func:`map_new_range`, as :class:`Graveyard` steps."""
    return [("unmap", va, size), ("release", handle, size), ("free_address", va, size)]


class Graveyard:
    """Teardown that survives driver failures.

    Pools update their own state first, then hand the driver steps of a teardown (unmap,
    release, free_address) to :meth:`run`. If a step fails, it and every later step are kept
    here, owned by the graveyard, and the error is raised; :meth:`retry` (called by
    ``empty_cache`` and ``close``) runs them again. So after any failure every driver resource
    is owned by exactly one block or by the graveyard: nothing leaks, nothing is freed twice.

    Teardowns that need not happen now (a cached stitched range evicted on the allocation path:
    it holds no physical memory of its own) can be :meth:`defer` red: they are run together by
    :meth:`flush`, after a single device synchronization, once ``DEFER_LIMIT`` of them wait or
    when memory is being given back. Unmapping needs the device idle (see :meth:`run`); on a
    training step, one synchronization per eviction would stall the GPU pipeline every time.
    """

    DEFER_LIMIT = 64  # teardowns batched behind one synchronization

    def __init__(self, driver) -> None:
        self.driver = driver
        self.pending: list[tuple[str, int, int]] = []  # (op, a, b) in order: failed, to retry
        self.deferred: list[tuple[str, int, int]] = []  # not run yet, on purpose
        self._deferred_count = 0

    def run(self, steps: list[tuple[str, int, int]]) -> None:
        if any(op == "unmap" for op, _, _ in steps):
            # No GPU work may still touch a range we unmap: a kernel or memset queued on memory
            # the program already freed would fault (CUDA_ERROR_ILLEGAL_ADDRESS, seen on the
            # H200). The simulated driver's synchronize is free.
            try:
                self.driver.synchronize()
            except Exception:
                self.pending.extend(steps)
                raise
        for i, step in enumerate(steps):
            try:
                self._do(step)
            except Exception:
                self.pending.extend(steps[i:])
                raise

    def _do(self, step: tuple[str, int, int]) -> None:
        op, a, b = step
        if op == "unmap":
            self.driver.unmap(a, b)
        elif op == "release":
            self.driver.release(a)
        elif op == "free_address":
            self.driver.free_address(a, b)
        else:
            raise ValueError(f"unknown teardown step {op!r}")

    def defer(self, steps: list[tuple[str, int, int]]) -> None:
        """Keep a teardown for the next :meth:`flush` (run at once past ``DEFER_LIMIT``)."""
        self.deferred.extend(steps)
        self._deferred_count += 1
        if self._deferred_count >= self.DEFER_LIMIT:
            self.flush()

    def flush(self) -> None:
        """Run every deferred teardown, behind one synchronization."""
        if self.deferred:
            steps, self.deferred, self._deferred_count = self.deferred, [], 0
            self.run(steps)

    def retry(self) -> None:
        """Run the pending steps again, in order, then the deferred ones; stops (and raises) at
        the first failure."""
        steps, self.pending = self.pending, []
        self.run(steps)
        self.flush()

    def _held(self):
        yield from self.pending
        yield from self.deferred

    def handles(self) -> set[int]:
        return {a for op, a, _ in self._held() if op == "release"}

    def held_bytes(self) -> int:
        """Physical bytes of handles that are still waiting to be released."""
        return sum(b for op, _, b in self._held() if op == "release")

    def mappings(self) -> int:
        return sum(1 for op, _, _ in self._held() if op == "unmap")

    def reservations(self) -> set[int]:
        return {a for op, a, _ in self._held() if op == "free_address"}
