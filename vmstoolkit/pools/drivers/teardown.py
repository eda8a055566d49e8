"""Teardown of driver resources that survives driver failures and batches device syncs."""

from __future__ import annotations

from vmstoolkit.errors import ConfigError


def unmap_range_steps(va: int, size: int, handle: int) -> list[tuple[str, int, int]]:
    """The teardown of :func:`map_new_range`, as :class:`Graveyard` steps. Cost: O(1); no driver
    call (running them makes three, after one synchronize)."""
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
        """Run teardown ``steps`` (``(op, a, b)``: ``unmap``, ``release``, ``free_address``, ``mem_free``)
        in order, after one device synchronize when any unmaps (queued work may still touch the range);
        the failed step and those after it are kept in ``pending`` for :meth:`retry`, and the error
        raised. Cost: O(s) for s steps; one driver call per step, plus one synchronize (which blocks
        the host on a real device) when any step unmaps."""
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
        elif op == "mem_free":
            self.driver.mem_free(a)
        else:
            raise ConfigError(f"unknown teardown step {op!r} (unmap, release, free_address or mem_free)")

    def defer(self, steps: list[tuple[str, int, int]]) -> None:
        """Keep a teardown for the next :meth:`flush` (run at once past ``DEFER_LIMIT``). Cost:
        amortized O(s) for s steps and no driver call, but every ``DEFER_LIMIT``-th call pays the
        flush: one driver call per deferred step and one synchronize."""
        self.deferred.extend(steps)
        self._deferred_count += 1
        if self._deferred_count >= self.DEFER_LIMIT:
            self.flush()

    def flush(self) -> None:
        """Run every deferred teardown, behind one synchronization. Cost: O(d) for d deferred steps;
        d driver calls and one synchronize (none when nothing is deferred)."""
        if self.deferred:
            steps, self.deferred, self._deferred_count = self.deferred, [], 0
            self.run(steps)

    def retry(self) -> None:
        """Run the pending steps again, in order, then the deferred ones; stops (and raises) at
        the first failure. Cost: O(p + d) for p pending and d deferred steps; one driver call per
        step and up to two synchronizes (one per batch that unmaps)."""
        steps, self.pending = self.pending, []
        self.run(steps)
        self.flush()

    def _held(self):
        yield from self.pending
        yield from self.deferred

    def handles(self) -> set[int]:
        """The handles still waiting to be released. O(held steps)."""
        return {a for op, a, _ in self._held() if op == "release"}

    def held_bytes(self) -> int:
        """Physical bytes still waiting to be given back (handles to release, plain frees).
        Cost: O(held steps); no driver call."""
        return sum(b for op, _, b in self._held() if op in ("release", "mem_free"))

    def mappings(self) -> int:
        """How many unmaps are still waiting. O(held steps)."""
        return sum(1 for op, _, _ in self._held() if op == "unmap")

    def reservations(self) -> set[int]:
        """The addresses of the reservations still waiting to be freed. O(held steps)."""
        return {a for op, a, _ in self._held() if op == "free_address"}
