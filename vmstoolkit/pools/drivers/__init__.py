"""The driver seam: the interface every pool calls (:mod:`.base`), the simulated driver
(:mod:`.sim`, the readable reference, and :mod:`.compiled`, its book-keeping in Numba: the
one replays use), the real CUDA driver (:mod:`.cuda`), and the driver-call sequences pools share:
transactions (:mod:`.txn`) and teardown (:mod:`.teardown`). :func:`make_driver` is the one place
that picks a driver; pools never import a concrete driver.
"""

from __future__ import annotations

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.drivers.base import Handle, VMMDriver
from vmstoolkit.units import parse_size

__all__ = ["Handle", "VMMDriver", "make_driver"]


def make_driver(kind: str = "sim", *, capacity: int | str | None = None, device: int = 0,
                peers: tuple[int, ...] = ()) -> VMMDriver:
    """The one place that picks a driver: ``"sim"`` (default: the compiled simulated driver),
    ``"sim-reference"`` (the Python one it is tested against, same results) or ``"cuda"``.

    ``capacity`` bounds the simulated device (default 141 GiB, an H200); the real driver
    ignores it, and grants ``peers`` (other devices) access to its mappings. A missing GPU
    raises :class:`~vmstoolkit.errors.NoGPUError`.

    Cost: O(1); the simulated drivers make no driver call, the real one a few (``cuInit``,
    ``cuDevicePrimaryCtxRetain``, ``cuMemGetAllocationGranularity``, ``cuMemGetInfo``...), none waits.
    """
    if kind == "sim":
        from vmstoolkit.pools.drivers.compiled import CompiledSimulatedDriver

        return CompiledSimulatedDriver(capacity=parse_size(capacity) if capacity is not None else None)
    if kind == "sim-reference":
        from vmstoolkit.pools.drivers.sim import SimulatedDriver

        return SimulatedDriver(capacity=parse_size(capacity) if capacity is not None else None)
    if kind == "cuda":
        from vmstoolkit.pools.drivers.cuda import CudaDriver

        return CudaDriver(device=device, peers=tuple(peers))
    raise ConfigError(f"unknown driver {kind!r} (choose 'sim', 'sim-reference' or 'cuda')")
