"""vmstoolkit allocators inside PyTorch, with no change to the user's model.

    import vmstoolkit.integrations.torch as vt
    handle = vt.install("paged")        # before the first CUDA tensor
    ... train as usual: torch.cuda.memory_allocated(), max_memory_reserved(), memory_summary(),
    reset_peak_memory_stats() and empty_cache() answer from the allocator ...

What a user gets (the drop-in contract, checked on the GPU by ``tests/gpu``):

- **streams**: a block freed by one stream is reused at once by that stream only; another stream
  gets it once the work queued before the free has finished (:mod:`vmstoolkit.pools.streams`);
- **record_stream**: ``tensor.record_stream(s)`` holds the memory until ``s``'s work is done;
- **out of memory**: an allocation the allocator cannot serve raises ``torch.OutOfMemoryError``
  (also inside ``backward()``), with the allocator's figures; the process goes on;
- **statistics**: every ``torch.cuda`` memory function, from the allocator (allocated: bytes of
  live requests; reserved: physical bytes mapped);
- **snapshots**: ``handle.record_history()`` / ``handle.dump_snapshot(path)`` write PyTorch's
  snapshot format, so a run under vmstoolkit can be replayed by vmstoolkit.

These need the compiled shim (:mod:`~vmstoolkit.integrations.torch_shim`), built on first use by
PyTorch's extension builder. Without a compiler the allocator still installs, with a one-line
warning: then a failed allocation returns a null pointer (PyTorch does not check it), and
statistics and ``record_stream`` come from Python-level patches that C++ callers do not see.

Allocators whose class names a compiled hook (``paged``: :mod:`~vmstoolkit.integrations.native_torch`)
serve PyTorch from compiled entry points; every other allocator through ``ctypes`` callbacks
into an :class:`~vmstoolkit.integrations.bridge.AllocatorBridge`. Either way the handle has the
same interface, and ``install`` knows no allocator by name. PyTorch calls the entry points from
its autograd threads too; each such thread keeps a pinned Python thread state
(:mod:`vmstoolkit.integrations.callbacks`). The allocator must be installed before PyTorch's
first CUDA allocation and cannot be swapped back afterwards: PyTorch's rule, enforced by PyTorch.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from vmstoolkit.errors import IntegrationError, NoGPUError
from vmstoolkit.integrations.abi import ALLOC_FN, EMPTY_FN, ERROR_FN, FREE_FN, RECORD_FN, RESET_FN, STATS_FN
from vmstoolkit.integrations.bridge import (
    STAT_KEYS, AllocatorBridge, HandleStats, cuda_driver, per_device, report_failed_malloc, torch_stats,
)
from vmstoolkit.integrations.callbacks import ThreadStatePins
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.adaptors import SnapshotLog, SnapshotLoggingAdaptor
from vmstoolkit.pools.registry import compiled_hook

_INSTALLED: "HookBase | None" = None


class HookBase(HandleStats):
    """What every handle PyTorch calls into shares: the shim's cold entry points (record_stream,
    statistics, resets, empty_cache, the last error), history recording, and the statistics calls.

    Subclasses provide ``bridge(device)`` (an object with ``stats``, ``allocator_stats``,
    ``record_stream``, ``reset_peak``, ``reset_accumulated``, ``empty_cache`` and ``last_error``),
    ``devices_in_use()``, and ``alloc_ptr``/``free_ptr``."""

    allocator_name = "abstract"
    runs_python = True
    """Whether ``alloc_ptr``/``free_ptr`` are Python callbacks: the shim then keeps a Python
    exception in flight out of their way (see ``csrc/torch_shim.cpp``, ``KeepPythonError``)."""

    def __init__(self) -> None:
        self.threads = ThreadStatePins()  # autograd's device threads call in: keep their states
        self.raises = False  # the shim raises torch.OutOfMemoryError: no report on stderr then
        self.shim_reason = ""  # why the shim is not in use, if it is not
        self.last_error: BaseException | None = None
        self.history: SnapshotLog | None = None  # the recorded events, once record_history was called
        self._recording = False
        self.record_fn = RECORD_FN(self._record)
        self.stats_fn = STATS_FN(self._stats)
        self.reset_fn = RESET_FN(self._reset)
        self.empty_fn = EMPTY_FN(self._empty)
        self.error_fn = ERROR_FN(self._error)

    # -- the shim's cold entry points (never raise into C++) ---------------------------------
    def _record(self, ptr, device, own, stream):
        try:
            self.threads.pin()
            self.bridge(device).record_stream(ptr or 0, stream or 0)
        except Exception as e:
            self.last_error = e

    def _stats(self, device, out, n):
        try:
            s = self.bridge(device).stats()
            for i, k in enumerate(STAT_KEYS[:n]):
                out[i] = int(s[k])
            return 0
        except Exception as e:
            self.last_error = e
            return -1

    def _reset(self, device, which):
        try:
            b = self.bridge(device)
            b.reset_accumulated() if which else b.reset_peak()
        except Exception as e:
            self.last_error = e

    def _empty(self):
        try:
            self.threads.pin()
            for dev in self.devices_in_use():
                self.bridge(dev).empty_cache()
        except Exception as e:
            self.last_error = e

    def _error(self, device, buf, n):
        try:
            err = self.bridge(device).last_error or self.last_error
            msg = f"{type(err).__name__}: {err}".encode()[: max(0, n - 1)] if err else b"no error recorded"
            ctypes.memmove(buf, msg, len(msg))
            return len(msg)
        except Exception:
            return 0

    @property
    def shim_pointers(self) -> tuple[int, ...]:
        """The seven entry points the shim takes, in its order."""
        c = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        return (self.alloc_ptr, self.free_ptr, c(self.record_fn), c(self.stats_fn), c(self.reset_fn),
                c(self.empty_fn), c(self.error_fn))

    # -- the statistics as PyTorch names them ------------------------------------------------
    def reset_peak_memory_stats(self, device: int = 0) -> None:
        self.bridge(device).reset_peak()

    def empty_cache(self) -> None:
        self._empty()

    # -- snapshots ---------------------------------------------------------------------------
    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000, clear: bool = False) -> None:
        """Record every allocation and free from now on (``enabled=False`` stops and keeps what was
        recorded; ``clear=True`` forgets it), as ``torch.cuda.memory._record_memory_history``
        would, into :attr:`history` (a :class:`~vmstoolkit.pools.adaptors.SnapshotLog`);
        :meth:`dump_snapshot` writes it. While recording, every device's allocator is wrapped in a
        :class:`~vmstoolkit.pools.adaptors.SnapshotLoggingAdaptor` writing to that log; nothing
        is wrapped otherwise."""
        if self.history is None:
            self.history = SnapshotLog(max_entries, settings={"vmstoolkit": self.allocator_name})
        elif clear:
            self.history.clear()
        self.history.max_entries = max_entries
        was, self._recording = self._recording, enabled
        if was != enabled:
            self._history_changed(enabled)

    def _history_changed(self, enabled: bool) -> None:
        """Start or stop logging every device in use (subclasses)."""

    def snapshot(self) -> dict:
        """The recorded history in PyTorch's snapshot format (``device_traces``; no segments)."""
        return (self.history or SnapshotLog(settings={"vmstoolkit": self.allocator_name})).snapshot()

    def dump_snapshot(self, path: str | Path) -> Path:
        """Write :meth:`snapshot` to ``path`` (gzip when it ends in ``.gz``); replay it with
        ``vmstoolkit replay PATH``."""
        return (self.history or SnapshotLog(settings={"vmstoolkit": self.allocator_name})).dump(path)


class TorchAllocatorHandle(HookBase):
    """The callbacks, the per-device bridges and their statistics (any Python allocator)."""

    def __init__(self, allocator: str, driver_factory, options: dict) -> None:
        super().__init__()
        self.allocator_name = allocator
        self._driver_factory = driver_factory
        self._options = options
        self.bridges: dict[int, AllocatorBridge] = {}
        self._loggers: dict[int, SnapshotLoggingAdaptor] = {}  # device -> its logging adaptor while recording
        self._make_lock = threading.Lock()
        self.alloc_fn = ALLOC_FN(self._alloc)
        self.free_fn = FREE_FN(self._free)

    def bridge(self, device: int) -> AllocatorBridge:
        """The device's bridge, made on first use, once, whichever threads ask at the same time."""
        def make():
            b = AllocatorBridge(make_allocator(self.allocator_name, self._driver_factory(device), **self._options))
            if self._recording:
                self._log_device(device, b)
            return b

        return per_device(self.bridges, self._make_lock, device, make)

    def _history_changed(self, enabled: bool) -> None:
        with self._make_lock:
            for dev, b in self.bridges.items():
                if enabled:
                    self._log_device(dev, b)
                else:
                    b.unwrap(self._loggers.pop(dev))

    def _log_device(self, device: int, b: AllocatorBridge) -> None:
        self._loggers[device] = b.wrap(lambda a: SnapshotLoggingAdaptor(a, self.history, device=device))

    def devices_in_use(self) -> list[int]:
        return list(self.bridges)

    def _alloc(self, size, device, stream):
        try:
            self.threads.pin()
            ptr = self.bridge(device).malloc(size, stream or 0, report=not self.raises)
            return ptr or None
        except Exception as e:  # never let an exception cross into C++
            self.last_error = e
            if not self.raises:
                report_failed_malloc(size, device, e)
            return None

    def _free(self, ptr, size, device, stream):
        try:
            self.threads.pin()
            self.bridge(device).free(ptr or 0, stream or 0)
        except Exception as e:
            self.last_error = e

    @property
    def alloc_ptr(self) -> int:
        return ctypes.cast(self.alloc_fn, ctypes.c_void_p).value

    @property
    def free_ptr(self) -> int:
        return ctypes.cast(self.free_fn, ctypes.c_void_p).value


def _import_torch():
    try:
        import torch
    except ImportError:
        raise IntegrationError("PyTorch is not installed: `pip install torch` to use vmstoolkit allocators inside PyTorch") from None
    if not torch.cuda.is_available():
        raise NoGPUError("PyTorch sees no CUDA GPU: the PyTorch integration needs one (replay works without: `vmstoolkit replay`)")
    return torch


def make_handle(allocator: str = "vms", driver_factory=None, **options) -> HookBase:
    """The handle without installing it (``driver_factory(device) -> VMMDriver``): compiled
    entry points where the allocator's class names a hook, ``ctypes`` callbacks otherwise."""
    driver_factory = driver_factory or cuda_driver
    from vmstoolkit.pools.registry import check_allocator

    check_allocator(allocator, options)  # name and options, before anything is built
    hook = compiled_hook(allocator)
    if hook:
        module, name = hook.split(":")
        return getattr(importlib.import_module(module), name)(driver_factory, **options)
    return TorchAllocatorHandle(allocator, driver_factory, options)


def install(allocator: str = "vms", *, shim: bool = True, **options) -> HookBase:
    """Make PyTorch allocate CUDA memory through vmstoolkit's ``allocator``; one call, before
    the first CUDA tensor. Returns the handle (calling it twice returns the same one).

    ``shim=True`` (default) builds or loads the compiled shim (out-of-memory errors, statistics,
    ``record_stream``); ``shim=False``, or a machine that cannot build it, installs the bare
    hook with Python-level patches (one warning line says what is missing)."""
    global _INSTALLED
    if _INSTALLED is not None:
        if _INSTALLED.allocator_name != allocator:
            raise IntegrationError(f"vmstoolkit allocator {_INSTALLED.allocator_name!r} is already installed in PyTorch; it cannot be changed to {allocator!r}")
        return _INSTALLED
    torch = _import_torch()
    handle = make_handle(allocator, **options)
    module, reason = (None, "shim=False") if not shim else _load_shim()
    try:
        if module is not None:
            module.install(*handle.shim_pointers, handle.runs_python)
            handle.raises = True
        else:
            handle.shim_reason = reason
            custom = torch._C._cuda_customAllocator(handle.alloc_ptr, handle.free_ptr)
            torch._C._cuda_changeCurrentAllocator(custom)
            handle._torch_allocator = custom
            _patch_python_side(torch, handle)
            sys.stderr.write(f"vmstoolkit: installed {allocator!r} without the compiled shim ({reason}): a failed "
                             "allocation returns a null pointer instead of raising torch.OutOfMemoryError, statistics "
                             "and record_stream are patched in Python only (C++ callers do not see them)"
                             + ("" if not handle.runs_python else ", and an exception unwinding past CUDA temporaries "
                                "can be lost (SystemError)") + "\n")
    except RuntimeError as e:
        raise IntegrationError(f"PyTorch refused the allocator ({e}); install it before the first CUDA allocation") from None
    _INSTALLED = handle
    return handle


def _load_shim():
    from vmstoolkit.integrations import torch_shim

    return torch_shim.load()


def nested_stats(flat: dict) -> dict:
    """``torch._C._cuda_memoryStats``'s nested form of :func:`torch_stats`, every pool and
    metric ``torch.cuda.memory_summary`` reads present (zero where vmstoolkit has no such thing)."""
    out: dict = {}
    for metric in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                   "active_bytes", "inactive_split_bytes", "requested_bytes"):
        out[metric] = {pool: {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
                       for pool in ("all", "small_pool", "large_pool")}
    for k in ("oversize_allocations", "oversize_segments"):
        out[k] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    for key, value in flat.items():
        parts = key.split(".")
        if len(parts) == 3:
            out[parts[0]][parts[1]][parts[2]] = value
        else:
            out[key] = value
    out["allocation"]["all"].update(out["active"]["all"])
    out.setdefault("num_sync_all_streams", 0)
    out.setdefault("max_split_size", -1)
    return out


def _patch_python_side(torch, handle: HookBase) -> None:
    """Without the shim: PyTorch's statistics, resets, empty_cache and record_stream, patched at
    the Python level (what ``torch.cuda`` calls at call time)."""
    C = torch._C

    def dev(d):
        return torch.cuda.current_device() if d is None or d < 0 else int(d)

    C._cuda_memoryStats = lambda d: nested_stats(handle.bridge(dev(d)).stats())
    C._cuda_resetPeakMemoryStats = lambda d: handle.bridge(dev(d)).reset_peak()
    C._cuda_resetAccumulatedMemoryStats = lambda d: handle.bridge(dev(d)).reset_accumulated()
    C._cuda_emptyCache = lambda *a: handle.empty_cache()
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.is_cuda:
            handle.bridge(self.device.index).record_stream(self.untyped_storage().data_ptr(), stream.cuda_stream)
        return original(self, stream)

    torch.Tensor.record_stream = record_stream


@contextmanager
def vmstoolkit_allocator(allocator: str = "vms", **options):
    """``with vmstoolkit_allocator("vms") as h:`` installs the allocator (once per process) and
    yields its handle; on exit it waits for the GPU so the statistics are final."""
    handle = install(allocator, **options)
    try:
        yield handle
    finally:
        import torch

        torch.cuda.synchronize()


def installed() -> HookBase | None:
    return _INSTALLED


__all__ = ["ALLOC_FN", "FREE_FN", "HookBase", "TorchAllocatorHandle", "install", "installed", "make_handle",
           "nested_stats", "torch_stats", "vmstoolkit_allocator"]
