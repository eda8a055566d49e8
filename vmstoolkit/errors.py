"""The exceptions of vmstoolkit: one base class, one type per kind of failure.

Every error vmstoolkit raises on purpose is a :class:`VmsError` (the runtime's
:class:`~vmstoolkit.exec.errors.ExecError` family included), so ``except VmsError`` catches them
all and the CLI's one handler prints any of them as one line. Where a built-in exception type
says the same thing, it is a second base (``ConfigError`` is a ``ValueError``,
``OutOfMemoryError`` a ``MemoryError``), so code that catches the built-in keeps working.
Every message names the problem and the values involved.
"""

from __future__ import annotations


class VmsError(Exception):
    """Base class of every error vmstoolkit raises on purpose."""


class InvalidSizeError(VmsError, ValueError):
    """A size that is not one: zero or below where a positive one is needed, not an integer, not a
    multiple of the granularity, or a string that does not parse (``"12 parsecs"``)."""


class InvalidFreeError(VmsError, KeyError):
    """A free of an address that no live allocation starts at (unknown or already freed)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(InvalidFreeError):
    """A free of an address whose allocation was already freed."""


class AllocatorClosedError(VmsError, RuntimeError):
    """A request to an allocator after its ``close()``: it gave everything back and serves nothing."""


class OutOfMemoryError(VmsError, MemoryError):
    """The physical memory cannot serve a request, even after releasing every cached block."""

    def __init__(self, message: str, *, requested: int = 0, reserved: int = 0, capacity: int | None = None,
                 limit: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.reserved = reserved
        self.capacity = capacity
        self.limit = limit  # the byte limit that refused the request (pools.adaptors.LimitingAdaptor), if any


class DriverError(VmsError, RuntimeError):
    """A VMM driver call failed; ``result`` is the CUresult name (``CUDA_ERROR_OUT_OF_MEMORY``)."""

    def __init__(self, result: str, message: str, *, code: int | None = None):
        super().__init__(f"{result}: {message}")
        self.result = result
        self.code = code


class DriverOutOfMemoryError(DriverError):
    """``CUDA_ERROR_OUT_OF_MEMORY`` from the driver: the allocator may release caches and retry."""


class TraceFormatError(VmsError, ValueError):
    """A memory snapshot that cannot be read: truncated, corrupt, or not a snapshot."""


class ConfigError(VmsError, ValueError):
    """An unknown name (allocator, option, driver, driver operation), a bad option value, or a
    malformed configuration string."""


class KernelError(VmsError, ValueError):
    """A kernel given arrays or launch settings it cannot take (a shape, dtype, layout, tile
    shape or variant), named with the value."""


class NoGPUError(VmsError, RuntimeError):
    """A real GPU path was asked for on a machine without a usable CUDA GPU."""


class IntegrationError(VmsError, RuntimeError):
    """A framework integration that cannot be set up or used as asked: the framework is missing,
    refuses the hook, or already runs another vmstoolkit allocator."""


class ClusterError(VmsError, RuntimeError):
    """A ``--cluster`` value that names no usable cluster: malformed, unreachable, no Dask."""
