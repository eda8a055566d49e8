"""A small transaction for multi-step driver sequences (create, reserve, map, set access).

Each step registers its undo right after it succeeds; leaving the ``with`` block without
``commit()`` (an exception) runs the undos in reverse order, so a failure in the middle leaves
nothing created, reserved or mapped. An undo that itself fails is reported on the original
error as a note, never hidden; undos given as teardown steps (``tx.undo("release", h, size)``)
to a transaction that has a :class:`~vmstoolkit.pools.drivers.teardown.Graveyard` are run through it,
so a failing undo leaves its resource owned by the graveyard, to be retried, not leaked.

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

from vmstoolkit.errors import ConfigError


class Transaction:
    def __init__(self, graveyard=None) -> None:
        self._undo: list = []  # callables, or (op, a, b) teardown steps
        self._committed = False
        self._graveyard = graveyard

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Register ``undo``, run if the transaction is left by an exception before :meth:`commit` (undos
        run newest first). O(1)."""
        self._undo.append(undo)

    def undo(self, op: str, a: int, b: int) -> None:
        """Register a teardown step (``unmap``, ``release``, ``free_address``) as an undo. Cost: O(1)
        amortized; no driver call."""
        if self._graveyard is None:
            raise ConfigError(f"teardown-step undo {op!r} needs a transaction made with a graveyard")
        self._undo.append((op, a, b))

    def undo_steps(self, steps) -> None:
        """Register teardown steps ``(op, a, b)`` at once, in order, as :meth:`undo` each would
        (the driver's batched calls: :meth:`~vmstoolkit.pools.drivers.base.VMMDriver.create_mapped`).
        A :class:`StepRun` is kept as it is, its steps made only if the transaction rolls back.
        Cost: O(len(steps)), O(1) for a :class:`StepRun`; no driver call."""
        if self._graveyard is None:
            raise ConfigError("teardown-step undos need a transaction made with a graveyard")
        if type(steps) is StepRun:
            self._undo.append(steps)
        else:
            self._undo.extend(steps)

    def commit(self) -> None:
        """Every step succeeded: forget the undos (nothing is rolled back on leaving). O(1)."""
        self._committed = True
        self._undo.clear()

    def rollback(self) -> list[BaseException]:
        """Run the undos, newest first, teardown steps through the graveyard (a failed one waits there),
        callables directly; keeps going past failures and returns their errors. Cost: O(u) for u
        undos; one driver call per teardown step, and one synchronize per run of consecutive
        teardown steps that unmaps (:meth:`Graveyard.run <vmstoolkit.pools.drivers.teardown.Graveyard.run>`)."""
        errors = []
        if any(type(u) is StepRun for u in self._undo):
            self._undo = [x for u in self._undo for x in (u if type(u) is StepRun else (u,))]
        while self._undo:
            undo = self._undo.pop()
            if isinstance(undo, tuple):
                steps = [undo]
                while self._undo and isinstance(self._undo[-1], tuple):
                    steps.append(self._undo.pop())
                try:
                    self._graveyard.run(steps)  # a failed step and the rest wait there
                except Exception as e:
                    errors.append(e)
                continue
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


class StepRun:
    """The undo steps of a batch of chunks ``size`` bytes each from ``va``, as a sequence made
    when read: with ``handles``, ``("release", h, size)`` for each handle, each followed by
    ``("unmap", va + i * size, size)`` while ``i < mapped``; without, only the ``mapped`` unmaps.
    What the compiled driver's batched calls register (a tuple per chunk, made and dropped at
    commit, was most of their Python work). Cost: O(1) to make, O(steps) to read."""

    __slots__ = ("va", "size", "handles", "mapped")

    def __init__(self, va: int, size: int, handles: list | None, mapped: int) -> None:
        self.va, self.size, self.handles, self.mapped = va, size, handles, mapped

    def __iter__(self):
        va, size, mapped = self.va, self.size, self.mapped
        if self.handles is None:
            for i in range(mapped):
                yield ("unmap", va + i * size, size)
            return
        for i, h in enumerate(self.handles):
            yield ("release", h, size)
            if i < mapped:
                yield ("unmap", va + i * size, size)

    def __len__(self) -> int:
        return self.mapped + (0 if self.handles is None else len(self.handles))


def map_new_range(driver, size: int, graveyard) -> tuple[int, int]:
    """``(va, handle)`` of ``size`` fresh bytes: create, reserve, map, set access, all or nothing.
    Cost: O(1); four driver calls (``cuMemCreate``, ``cuMemAddressReserve``, ``cuMemMap``,
    ``cuMemSetAccess``), and on failure the undos of those done, behind one synchronize."""
    with Transaction(graveyard) as tx:
        h = driver.create(size)
        tx.undo("release", h, size)
        va = driver.reserve(size)
        tx.undo("free_address", va, size)
        driver.map(va, size, h)
        tx.undo("unmap", va, size)
        driver.set_access(va, size)
        tx.commit()
    return va, h
