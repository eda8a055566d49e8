"""Errors of the memory-aware runtime."""

from __future__ import annotations


class ExecError(Exception):
    """Base class of the runtime's errors."""


class BudgetTooSmallError(ExecError):
    """No schedule fits: one vertex alone needs more GPU memory than the budget."""

    def __init__(self, vertex: str, gpu: int, needed: int, budget: int, detail: str = ""):
        self.vertex, self.gpu, self.needed, self.budget = vertex, gpu, needed, budget
        msg = (
            f"no schedule fits: vertex {vertex!r} on GPU {gpu} needs {needed} bytes "
            f"({needed / 2**20:.1f} MiB) of inputs and outputs resident, budget is {budget} bytes "
            f"({budget / 2**20:.1f} MiB)"
        )
        super().__init__(msg + (f"; {detail}" if detail else ""))


class RaceError(ExecError):
    """The race checker found two overlapping buffers that the graph does not order."""

    def __init__(self, first: str, second: str, gpu: int, lo: int, hi: int):
        self.first, self.second, self.gpu, self.lo, self.hi = first, second, gpu, lo, hi
        super().__init__(
            f"race on GPU {gpu} bytes [{lo}, {hi}): {first} is still in use when {second} is written "
            f"(no path from its last access to the writer)"
        )
