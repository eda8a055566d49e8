"""The runtime's backends, and :func:`make_backend`: the one place that picks one, as
:func:`~vmstoolkit.pools.drivers.make_driver` picks a driver.

- :mod:`.base`: the protocol every backend speaks;
- :mod:`.sim`: a discrete-event simulation on the CPU (with optional numpy numerics);
- :mod:`.cuda`: Numba kernels on real GPUs, with pinned host memory (:mod:`.host_memory`).

>>> kind = backend_kind("sim"); kind.real
False
>>> be = make_backend(kind, seed=1); type(be).__name__
'SimBackend'
"""

from __future__ import annotations

from enum import Enum

from vmstoolkit.exec.errors import InvalidOptionError


class BackendKind(str, Enum):
    """Where a memory graph runs: ``sim`` (simulated, any machine) or ``cuda`` (the GPU)."""

    sim = "sim"
    cuda = "cuda"

    @property
    def real(self) -> bool:
        """Runs on GPUs: needs them present, and real host values for every weight and input."""
        return self is BackendKind.cuda


BACKENDS = tuple(k.value for k in BackendKind)


def backend_kind(kind: str | BackendKind) -> BackendKind:
    """``kind`` as a :class:`BackendKind`; anything else raises
    :class:`~vmstoolkit.exec.errors.InvalidOptionError` naming it. Runtime complexity: O(1)."""
    try:
        return BackendKind(kind)
    except ValueError:
        raise InvalidOptionError(f"unknown backend {kind!r} (choose one of: {', '.join(BACKENDS)})") from None


def make_backend(kind: str | BackendKind = "sim", *, cost=None, seed: int = 0, jitter: float = 0.2,
                 numerics: bool = False, values: dict | None = None, timeline: bool = False, **cuda_options):
    """A new backend of ``kind`` (:func:`backend_kind`).

    ``sim`` takes the cost model ``cost`` (default :class:`~vmstoolkit.exec.backends.sim.CostModel`),
    the ``seed`` and ``jitter`` of its durations, and with ``numerics`` computes ``values``
    through the graph; it records spans anyway and ignores ``timeline`` and ``cuda_options``.
    ``cuda`` takes ``values`` (host arrays of every weight and input), ``timeline`` (CUDA events
    around every vertex) and the keywords of :class:`~vmstoolkit.exec.backends.cuda.CudaBackend`
    (``pin``, ``pool``, ``allocator``, ...); it ignores ``cost``, ``seed``, ``jitter`` and
    ``numerics``. Runtime complexity: O(1) (the cuda backend does its work at ``setup``)."""
    kind = backend_kind(kind)
    if kind.real:
        from vmstoolkit.exec.backends.cuda import CudaBackend

        return CudaBackend(values if values is not None else {}, timeline=timeline, **cuda_options)
    from vmstoolkit.exec.backends.sim import SimBackend

    return SimBackend(cost, seed=seed, jitter=jitter, numerics=numerics, values=values)


def lower_bound(kind: str | BackendKind, mg, *, cost=None, values: dict | None = None) -> dict:
    """The makespan no schedule of memory graph ``mg`` can beat on ``kind``: from ``cost`` on
    ``sim`` (:meth:`~vmstoolkit.exec.backends.sim.CostModel.lower_bound`), measured on the GPU
    with ``values`` on ``cuda`` (:func:`~vmstoolkit.exec.backends.cuda.measure_lower_bound`)."""
    if backend_kind(kind).real:
        from vmstoolkit.exec.backends.cuda import measure_lower_bound

        return measure_lower_bound(mg, values)
    from vmstoolkit.exec.backends.sim import CostModel

    return (cost or CostModel()).lower_bound(mg)


def require_gpus(n: int) -> None:
    """Raise :class:`~vmstoolkit.errors.NoGPUError` (one line) unless this machine has ``n``
    usable CUDA GPUs for the cuda backend."""
    from vmstoolkit.errors import NoGPUError
    from vmstoolkit.pools.drivers.cuda import cuda_init

    try:
        cuda_init(n - 1)
    except NoGPUError as e:
        reason = " ".join(str(e).split()).split("; use the simulated driver")[0]
        raise NoGPUError(f"the cuda backend needs {n} CUDA GPU(s): {reason}; the sim backend runs without one") from None


__all__ = ["BackendKind", "BACKENDS", "backend_kind", "make_backend", "lower_bound", "require_gpus"]
