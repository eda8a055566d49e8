"""Errors of the memory-aware runtime, members of the :class:`~vmstoolkit.errors.VmsError` family."""

from __future__ import annotations

from vmstoolkit.errors import DriverError, VmsError


class ExecError(VmsError):
    """Base class of the runtime's errors: every error it raises on purpose is one of these."""


class InvalidGraphError(ExecError, ValueError):
    """A task graph that cannot be built or run as asked: an unknown op, a tensor read before it
    is written or written twice, more GPUs than it is compiled for, an op with no numpy form."""


class InvalidOptionError(ExecError, ValueError):
    """An argument outside its choices or its range: an unknown executor, backend, variant or
    notification mode, arguments that exclude each other, values a backend needs but lacks."""


class ExecutionError(ExecError, RuntimeError):
    """A run that cannot go on: the backend's drive loop stopped with work unfinished, or
    :func:`~vmstoolkit.exec.executor.execute` was called inside a running event loop."""


class CudaCallError(ExecError, DriverError):
    """A CUDA driver call of the runtime's backend failed; ``result`` names the CUresult."""


class InvalidShapeError(ExecError, ValueError):
    """A model or tensor shape that cannot be built: a size of zero, or widths that do not divide."""


class InvalidBudgetError(ExecError, ValueError):
    """A GPU budget that is not a positive whole number of bytes (NaN, infinite, zero, negative)."""


class BudgetTooSmallError(ExecError):
    """No schedule fits: one vertex alone needs more GPU memory than the budget."""

    def __init__(self, vertex: str, gpu: int, needed: int, budget: int, detail: str = ""):
        self.vertex, self.gpu, self.needed, self.budget = vertex, gpu, needed, budget
        from vmstoolkit.units import format_size

        msg = (
            f"no schedule fits: vertex {vertex!r} on GPU {gpu} needs {needed} bytes "
            f"({format_size(needed)}) of inputs and outputs resident, budget is {budget} bytes "
            f"({format_size(budget)})"
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


class CycleError(ExecError):
    """A memory graph whose edges form a cycle: its vertices could never become ready.

    ``vertices`` is one cycle as a path ``[a, b, ..., a]`` along the graph's edges."""

    SHOWN = 8  # vertices named in the message; longer cycles are cut in the middle

    def __init__(self, vertices: list[int], names: list[str]):
        self.vertices = vertices
        steps = [f"vertex {v} {n!r}" for v, n in zip(vertices, names)]
        if len(steps) > self.SHOWN:
            steps = steps[: self.SHOWN // 2] + [f"... ({len(vertices) - self.SHOWN} more)"] + steps[-self.SHOWN // 2:]
        super().__init__(f"the memory graph has a cycle of {len(vertices) - 1} vertices, which can never "
                         f"run: {' -> '.join(steps)}")


class CheckpointError(ExecError, ValueError):
    """A model folder that cannot be loaded: no ``config.json``, a missing, truncated or corrupt
    safetensors shard, a tensor missing or of the wrong shape, or a setting the runtime does not
    implement (the message names the field and its value)."""


class HostBudgetError(ExecError, MemoryError):
    """A plan needs more host memory than the host budget; refused before anything is allocated."""
