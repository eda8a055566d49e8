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
  (also inside ``backward()``) whose message begins as PyTorch's own (``CUDA out of memory. Tried
  to allocate 1.00 GiB. GPU 0 has a total capacity of ...``: what accelerate's batch-size finder,
  Lightning and the HF Trainer match), then the allocator's figures; the process goes on;
- **statistics**: every ``torch.cuda`` memory function, from the allocator (allocated: bytes of
  live requests; reserved: physical bytes mapped);
- **CUDA graphs**: captures allocate from private pools with PyTorch's semantics
  (:mod:`vmstoolkit.pools.graph_pools`): memory freed inside a pool serves only that pool until it
  is released, pools can be shared, and cudagraph trees' live-allocation check and checkpoints
  answer, so ``torch.compile(mode="reduce-overhead")`` runs;
- **memory fraction**: ``torch.cuda.set_per_process_memory_fraction(f)`` caps the live bytes at
  ``f`` of the device (a :class:`~vmstoolkit.pools.adaptors.LimitingAdaptor`; PyTorch caps what
  it reserves), past which allocations raise ``torch.OutOfMemoryError``;
- **snapshots**: PyTorch's own ``torch.cuda.memory._record_memory_history`` (``stacks="python"``,
  ``max_entries``, ``enabled=None``), ``_snapshot``, ``_dump_snapshot`` and ``memory_snapshot()``
  answer from the allocator in PyTorch's format (one writer:
  :class:`~vmstoolkit.pools.adaptors.SnapshotLog`), which ``torch.cuda._memory_viz`` and
  ``vmstoolkit replay`` read; ``handle.record_history()`` / ``handle.dump_snapshot(path)`` too;
- **exit**: no call reaches Python once the interpreter finalizes (a late free is dropped).

Beside this global route, :func:`use_pool` / :func:`mem_pool` give a ``torch.cuda.MemPool`` backed
by any vmstoolkit allocator, for one part of a program, taken after CUDA is initialised (PyTorch's
caching allocator then splits vmstoolkit's segments; see :func:`mem_pool` for what differs).

These need the compiled shim (:mod:`~vmstoolkit.integrations.torch_shim`), built on first use by
PyTorch's extension builder. Without a compiler the allocator still installs, with a one-line
warning: then a failed allocation returns a null pointer (PyTorch does not check it), statistics,
``record_stream`` and the fraction come from Python-level patches that C++ callers do not see, and
CUDA graphs get no private pools.

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

from vmstoolkit.errors import ConfigError, IntegrationError, NoGPUError
from vmstoolkit.integrations.abi import (ALLOC_FN, EMPTY_FN, ERROR_FN, FREE_FN, GET_FRACTION_FN, POOL_ALLOC_FN,
                                         POOL_EVENT_FN, POOL_EVENTS, POOL_FREE_FN, RECORD_FN, RESET_FN,
                                         SET_FRACTION_FN, STATS_FN)
from vmstoolkit.integrations.bridge import (STAT_KEYS, AllocatorBridge, HandleStats, cuda_driver, oom_message,
                                           per_device, report_failed_malloc, torch_stats)
from vmstoolkit.integrations.callbacks import ThreadStatePins
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.adaptors import LimitingAdaptor, SnapshotLog, SnapshotLoggingAdaptor
from vmstoolkit.pools.graph_pools import PrivatePools
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
        self._pending_error: BaseException | None = None  # a pool's or the limit's refusal, for the next message
        self.history: SnapshotLog | None = None  # the recorded events, once record_history was called
        self._recording = False
        self.shim = None  # the compiled shim's module, once installed through it
        self.fractions: dict[int, float] = {}  # device -> its memory fraction, where one was set
        self._pools: dict[int, PrivatePools] = {}  # device -> its CUDA-graph private pools
        self._pool_lock = threading.RLock()
        self.record_fn = RECORD_FN(self._record)
        self.stats_fn = STATS_FN(self._stats)
        self.reset_fn = RESET_FN(self._reset)
        self.empty_fn = EMPTY_FN(self._empty)
        self.error_fn = ERROR_FN(self._error)
        self.pool_alloc_fn = POOL_ALLOC_FN(self._pool_alloc)
        self.pool_free_fn = POOL_FREE_FN(self._pool_free)
        self.pool_event_fn = POOL_EVENT_FN(self._pool_event)
        self.set_fraction_fn = SET_FRACTION_FN(self._set_fraction)
        self.get_fraction_fn = GET_FRACTION_FN(self._get_fraction)

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

    def _error(self, device, size, buf, n):
        try:
            msg = self.oom_message(size, device).encode()[: max(0, n - 1)]
            ctypes.memmove(buf, msg, len(msg))
            return len(msg)
        except Exception:
            return 0

    def oom_message(self, size: int, device: int = 0) -> str:
        """The text of the ``torch.OutOfMemoryError`` the shim raises for a refused request of
        ``size`` bytes: PyTorch's own opening (:func:`~vmstoolkit.integrations.bridge.oom_message`),
        then the allocator's error."""
        err, self._pending_error = self._pending_error, None
        b = self.bridge(device)
        err = err or b.last_error or self.last_error
        why = f"{type(err).__name__}: {err}" if err else "no error recorded"
        s = b.stats()
        free, total = b.allocator.driver.mem_info()
        return oom_message(size, device, free, total, s["allocated_bytes.all.current"],
                           s["reserved_bytes.all.current"], f"{self.allocator_name} refused it: {why}")

    # -- private pools: CUDA graphs, cudagraph trees, MemPool (the shim routes; see graph_pools) ---
    def graph_pools(self, device: int) -> PrivatePools:
        """The device's private pools (made on first use) over :meth:`pool_upstream`."""
        with self._pool_lock:
            p = self._pools.get(device)
            if p is None:
                p = self._pools[device] = PrivatePools(self.pool_upstream(device))
            return p

    def pool_upstream(self, device: int):
        """What the device's pools allocate from: ``allocate(size, stream)`` / ``free(addr, stream)`` (subclasses)."""
        raise NotImplementedError

    def _pool_alloc(self, size, device, stream, id0, id1):
        try:
            self.threads.pin()
            with self._pool_lock:
                return self.graph_pools(device).allocate((id0, id1), size, stream or 0) or None
        except Exception as e:
            self.last_error = self._pending_error = e
            return None

    def _pool_free(self, ptr, size, device, stream, id0, id1):
        try:
            self.threads.pin()
            with self._pool_lock:
                self.graph_pools(device).free(ptr or 0)
        except Exception as e:
            self.last_error = e

    def _pool_event(self, device, id0, id1, what, ptr, size):
        try:
            self.threads.pin()
            event = POOL_EVENTS[what]
            with self._pool_lock:
                pools = self.graph_pools(device)
                if event == "use":
                    return pools.use((id0, id1))
                if event == "release":
                    return pools.release((id0, id1))
                if event == "take_back":
                    return int(pools.take_back((id0, id1), ptr or 0, size))
                return pools.use_count((id0, id1))
        except Exception as e:
            self.last_error = e
            return -1

    # -- the memory fraction (torch.cuda.set_per_process_memory_fraction) ----------------------
    def set_memory_fraction(self, fraction: float, device: int = 0) -> None:
        """Cap the bytes of live allocations on ``device`` at ``fraction`` of its total memory, as
        PyTorch's allocator caps what it reserves: a request past it raises
        :class:`~vmstoolkit.errors.OutOfMemoryError` (``torch.OutOfMemoryError`` through the shim).
        1.0 lifts the cap."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"memory fraction must be between 0 and 1, got {fraction!r}")
        fraction = float(fraction)
        driver = self.bridge(device).allocator.driver
        limit = None if fraction >= 1.0 else max(1, int(fraction * driver.mem_info()[1]))
        self.fractions[device] = fraction
        self._apply_limit(device, limit, f"set_per_process_memory_fraction({fraction:g})")

    def memory_fraction(self, device: int = 0) -> float:
        return self.fractions.get(device, 1.0)

    def _apply_limit(self, device: int, limit: int | None, why: str) -> None:
        """Enforce ``limit`` bytes of live allocations on ``device`` (None: no limit) (subclasses)."""
        raise NotImplementedError

    def _set_fraction(self, device, fraction):
        try:
            self.threads.pin()
            self.set_memory_fraction(fraction, device)
            return 0
        except Exception as e:
            self.last_error = e
            return -1

    def _get_fraction(self, device):
        return self.memory_fraction(device)

    @property
    def shim_pointers(self) -> tuple[int, ...]:
        """The twelve entry points the shim takes, in its order (``struct EntryPoints``)."""
        c = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        return (self.alloc_ptr, self.free_ptr, c(self.record_fn), c(self.stats_fn), c(self.reset_fn),
                c(self.empty_fn), c(self.error_fn), c(self.pool_alloc_fn), c(self.pool_free_fn),
                c(self.pool_event_fn), c(self.set_fraction_fn), c(self.get_fraction_fn))

    # -- the statistics as PyTorch names them ------------------------------------------------
    def reset_peak_memory_stats(self, device: int = 0) -> None:
        self.bridge(device).reset_peak()

    def empty_cache(self) -> None:
        self._empty()

    # -- snapshots ---------------------------------------------------------------------------
    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000, clear: bool = False, *,
                       stacks: str | None = None, trace: bool = True, keep: str = "first") -> None:
        """Record every allocation and free from now on (``enabled=False`` stops and keeps what was
        recorded; ``clear=True`` forgets it), as ``torch.cuda.memory._record_memory_history``
        would, into :attr:`history` (a :class:`~vmstoolkit.pools.adaptors.SnapshotLog`);
        :meth:`dump_snapshot` writes it. ``stacks="python"`` keeps each event's Python frames;
        ``trace=False`` only those of live allocations; ``keep`` which events ``max_entries``
        keeps (``"first"``, or ``"last"`` as PyTorch does). While recording, every device's
        allocator is wrapped in a :class:`~vmstoolkit.pools.adaptors.SnapshotLoggingAdaptor`
        writing to that log (the compiled ``paged`` hook takes its Python path); nothing is
        wrapped otherwise. Under install, PyTorch's own functions call this (see :func:`install`)."""
        if self.history is None:
            self.history = SnapshotLog(max_entries, settings={"vmstoolkit": self.allocator_name}, keep=keep)
        elif clear:
            self.history.clear()
        if enabled:
            if self.history.keep != keep:
                self.history.keep = keep
            self.history.resize(max_entries)
            self.history.stacks, self.history.trace = stacks, trace
        was, self._recording = self._recording, enabled
        if was != enabled:
            self._history_changed(enabled)

    @property
    def recording(self) -> bool:
        return self._recording

    def _history_changed(self, enabled: bool) -> None:
        """Start or stop logging every device in use (subclasses)."""

    def live_blocks(self) -> list[tuple]:
        """``(address, size, device, stream, pool id)`` of every live allocation PyTorch holds: the
        shim's record when installed through it, else what the Python allocators know."""
        if self.shim is not None:
            return [(a, n, d, s, (p0, p1)) for a, n, d, s, p0, p1 in self.shim.live_blocks()]
        if not self.runs_python:  # the compiled hook's blocks are not in the Python bookkeeping
            return []
        return [(a, n, dev, 0, (0, 0)) for dev in self.devices_in_use()
                for a, n in self.bridge(dev).allocator.live_allocations().items()]

    def snapshot(self, include_traces: bool = True, pool: tuple[int, int] | None = None) -> dict:
        """PyTorch's snapshot dict (``torch.cuda.memory._snapshot()``): the recorded history in
        ``device_traces`` and a segment per live allocation (written by
        :meth:`~vmstoolkit.pools.adaptors.SnapshotLog.snapshot`)."""
        log = self.history or SnapshotLog(settings={"vmstoolkit": self.allocator_name})
        return log.snapshot(self.live_blocks(), include_traces=include_traces, pool=pool)

    def dump_snapshot(self, path: str | Path) -> Path:
        """Write :meth:`snapshot` to ``path`` (gzip when it ends in ``.gz``); replay it with
        ``vmstoolkit replay PATH``."""
        log = self.history or SnapshotLog(settings={"vmstoolkit": self.allocator_name})
        return log.dump(path, self.live_blocks())


class TorchAllocatorHandle(HookBase):
    """The callbacks, the per-device bridges and their statistics (any Python allocator)."""

    def __init__(self, allocator: str, driver_factory, options: dict) -> None:
        super().__init__()
        self.allocator_name = allocator
        self._driver_factory = driver_factory
        self._options = options
        self.bridges: dict[int, AllocatorBridge] = {}
        self._loggers: dict[int, SnapshotLoggingAdaptor] = {}  # device -> its logging adaptor while recording
        self._limiters: dict[int, LimitingAdaptor] = {}  # device -> its limit, while a memory fraction is set
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

    def pool_upstream(self, device: int) -> "_BridgeUpstream":
        return _BridgeUpstream(self.bridge(device))

    def _apply_limit(self, device: int, limit: int | None, why: str) -> None:
        b = self.bridge(device)
        lim = self._limiters.get(device)
        if limit is None:
            if lim is not None:
                b.unwrap(self._limiters.pop(device))
        elif lim is not None:
            lim.limit, lim.why = limit, why
        else:
            self._limiters[device] = b.wrap(lambda a: LimitingAdaptor(a, limit, why))

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


class _BridgeUpstream:
    """A bridge's allocator as the private pools' upstream: allocations under the bridge's lock,
    errors raised (the pool callbacks catch them); frees through the bridge (a bad one is kept in
    its ``last_error``)."""

    def __init__(self, bridge: AllocatorBridge) -> None:
        self.bridge = bridge

    def allocate(self, size: int, stream: int = 0) -> int:
        with self.bridge.held():
            return self.bridge.allocator.allocate(int(size), int(stream))

    def free(self, addr: int, stream: int | None = None) -> None:
        self.bridge.free(int(addr), stream)  # queued when it re-enters (the garbage collector inside allocate)


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
            # the handle is kept alive by the shim for the process's life: PyTorch calls its entry
            # points until the very end (tensors freed while the interpreter finalizes)
            module.install(list(handle.shim_pointers), handle.runs_python, handle)
            handle.raises = True
            handle.shim = module
        else:
            handle.shim_reason = reason
            custom = torch._C._cuda_customAllocator(handle.alloc_ptr, handle.free_ptr)
            torch._C._cuda_changeCurrentAllocator(custom)
            handle._torch_allocator = custom
            _patch_python_side(torch, handle)
            sys.stderr.write(f"vmstoolkit: installed {allocator!r} without the compiled shim ({reason}): a failed "
                             "allocation returns a null pointer instead of raising torch.OutOfMemoryError, statistics, "
                             "record_stream and the memory fraction are patched in Python only (C++ callers do not see "
                             "them), and CUDA graphs get no private pools (torch.compile's reduce-overhead mode fails)"
                             + ("" if not handle.runs_python else ", and an exception unwinding past CUDA temporaries "
                                "can be lost (SystemError)") + "\n")
    except RuntimeError as e:
        raise IntegrationError(f"PyTorch refused the allocator ({e}); install it before the first CUDA allocation") from None
    _patch_history_api(torch, handle)
    _INSTALLED = handle
    return handle


def _patch_history_api(torch, handle: HookBase) -> None:
    """PyTorch's snapshot functions answer from the handle: ``_record_memory_history`` (its
    ``enabled``, ``context``, ``stacks``, ``max_entries``, ``clear_history``, ``skip_actions``),
    ``_snapshot`` / ``_dump_snapshot`` / ``memory_snapshot()`` and ``_cuda_isHistoryEnabled``
    (cudagraph trees ask it). The allocator base class raises "does not yet support recordHistory"
    for them in C++, and they build their dict in C++ from its segments; so these are replaced
    where ``torch.cuda.memory`` calls them, in ``torch._C``, as Python sees them (C++ code
    calling the allocator's recordHistory directly is not served). ``stacks="all"`` records the
    Python frames only (no C++ frames)."""
    C = torch._C

    def record(enabled, context="all", stacks="all", max_entries=sys.maxsize, clear_history=False,
               compile_context=False, global_record_annotations=False, skip_actions=()):
        if enabled not in (None, "state", "all"):
            raise ConfigError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        handle.record_history(enabled is not None, max_entries=max(1, int(max_entries)), clear=bool(clear_history),
                              stacks="python" if context else None, trace=enabled == "all", keep="last")
        if handle.history is not None:
            handle.history.skip = frozenset(skip_actions or ())

    def record_legacy(enabled, record_context=True, trace_alloc_max_entries=1, trace_alloc_record_context=False,
                      record_context_cpp=False, clear_history=False, compile_context=False,
                      global_record_annotations=False, skip_actions=()):
        handle.record_history(bool(enabled), max_entries=max(1, int(trace_alloc_max_entries)), clear=bool(clear_history),
                              stacks="python" if record_context else None, trace=trace_alloc_max_entries > 1,
                              keep="last")

    def snapshot(arg=None):
        if arg is None:
            return handle.snapshot()
        id0, id1, include_traces = arg
        return handle.snapshot(include_traces=bool(include_traces), pool=None if (id0, id1) == (0, 0) else (id0, id1))

    C._cuda_record_memory_history = record
    C._cuda_record_memory_history_legacy = record_legacy
    C._cuda_memorySnapshot = snapshot
    C._cuda_isHistoryEnabled = lambda: handle.recording


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
    C._cuda_setMemoryFraction = lambda fraction, d: handle.set_memory_fraction(fraction, dev(d))
    C._cuda_getMemoryFraction = lambda d: handle.memory_fraction(dev(d))
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


# -- the MemPool route ---------------------------------------------------------------------------------
_POOL_HANDLES: dict[tuple, HookBase] = {}


def mem_pool(allocator: str = "paged", *, use_on_oom: bool = False, **options):
    """A ``torch.cuda.MemPool`` whose memory comes from vmstoolkit's ``allocator``: the route
    beside :func:`install`, which needs no install before CUDA starts and serves only what runs
    inside ``torch.cuda.use_mem_pool(pool)`` (or :func:`use_pool`), as vLLM's sleep-mode
    allocator does for its KV cache.

    What differs from the global install: PyTorch's caching allocator stays in charge and asks
    vmstoolkit only for its segments (2 MiB for small requests, whole rounded segments for large
    ones), splitting and caching them itself and keeping them while the pool lives (its last
    out-of-memory retry frees none), so the pool reserves what PyTorch's default would
    (``docs/results.md``, mempool-routes); expandable segments are off in such a pool;
    statistics, snapshots and out-of-memory errors are PyTorch's (its ``memory_allocated()``
    counts the pool's blocks; ``pool.vmstoolkit.memory_stats()`` the segments vmstoolkit gave);
    allocations of other threads (the backward pass runs on autograd's) go to PyTorch's own
    pools. The handle (``pool.vmstoolkit``) is made once per allocator and options and shared by
    the pools made with them. Refused while vmstoolkit is installed globally."""
    torch = _import_torch()
    if _INSTALLED is not None:
        raise IntegrationError(f"vmstoolkit's {_INSTALLED.allocator_name!r} is installed as PyTorch's allocator: "
                               "every allocation is vmstoolkit's already; mem_pool/use_pool serve PyTorch's own allocator")
    key = (allocator, tuple(sorted(options.items())))
    handle = _POOL_HANDLES.get(key)
    if handle is None:
        handle = make_handle(allocator, **options)
        handle.raises = True  # PyTorch's caching allocator checks the pointer and raises its own OOM
        handle._torch_allocator = torch._C._cuda_customAllocator(handle.alloc_ptr, handle.free_ptr)
        _POOL_HANDLES[key] = handle
    pool = torch.cuda.MemPool(handle._torch_allocator, use_on_oom=use_on_oom)
    pool.vmstoolkit = handle
    return pool


@contextmanager
def use_pool(allocator: str = "paged", *, device=None, **options):
    """``with use_pool("paged") as pool:`` the current thread's CUDA allocations come from a new
    :func:`mem_pool` of ``allocator`` (``torch.cuda.use_mem_pool``); keep ``pool`` to use it again
    (``with torch.cuda.use_mem_pool(pool):``). Its memory is given back when the pool and every
    tensor in it are gone and ``torch.cuda.empty_cache()`` runs."""
    torch = _import_torch()
    pool = mem_pool(allocator, **options)
    with torch.cuda.use_mem_pool(pool, device):
        yield pool


__all__ = ["ALLOC_FN", "FREE_FN", "HookBase", "TorchAllocatorHandle", "install", "installed", "make_handle", "mem_pool",
           "nested_stats", "torch_stats", "use_pool", "vmstoolkit_allocator"]
