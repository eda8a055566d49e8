"""What the executors need from a backend: the one protocol every backend speaks.

The executors (:mod:`vmstoolkit.exec.executor`) and the experiments call only these methods, and
every backend has all of them (the simulated one gives nothing back on :meth:`Backend.close`), so
no caller probes a backend for what it offers.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

import numpy as np

from vmstoolkit.exec.errors import InvalidOptionError


@runtime_checkable
class Backend(Protocol):
    """A place that runs memory graphs: :class:`~vmstoolkit.exec.backends.sim.SimBackend`
    (discrete-event simulation, optional numpy numerics) or
    :class:`~vmstoolkit.exec.backends.cuda.CudaBackend` (Numba kernels on a GPU)."""

    def setup(self, mg) -> None:
        """Take one region of ``mg.budget`` bytes per GPU and fill the preloaded buffers."""

    def clock(self) -> float:
        """Seconds, on the backend's clock (virtual for the simulation)."""

    def launch(self, v) -> Any:
        """Enqueue vertex ``v`` on the stream ``(v.gpu, v.stream)`` and mark its end; returns a
        token for :meth:`completion`."""

    def completion(self, token) -> asyncio.Future:
        """A future that resolves, on the running loop, once the launched work is done."""

    async def drive(self, done: asyncio.Future) -> None:
        """Run beside the executor until ``done`` resolves (the simulation advances its virtual
        clock here; a GPU backend only waits). Returning before ``done`` resolves means the
        backend failed: the executor then ends the run with this loop's error."""

    def result(self, ids=None) -> dict[int, np.ndarray]:
        """Values of the graph's output tensors (only those in ``ids``, when given) after a run
        that computed them, as host arrays of their own."""

    def close(self) -> None:
        """Give back what :meth:`setup` took (GPU regions); may be called more than once."""


def select_outputs(locations: dict, ids=None) -> list:
    """``locations``' (tensor, buffer) items for :meth:`Backend.result`: all, or those of ``ids``
    in their order; an id that is not an output is an error naming it."""
    if ids is None:
        return list(locations.items())
    missing = [t for t in ids if t not in locations]
    if missing:
        raise InvalidOptionError(f"result(): tensors {missing[:5]} are not outputs of the graph")
    return [(t, locations[t]) for t in ids]
