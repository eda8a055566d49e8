"""Host memory of the CUDA backend: where weights, inputs and offloaded tensors live on the host,
and how that memory becomes page-locked (pinned) without doubling it or paying for it every run.

Note [Pinned host memory]
-------------------------
Rationale. Copies between the GPU and the host run asynchronously and at full bandwidth only
from page-locked memory. The backend used to pin a fresh copy of every weight and input
(``cuMemHostAlloc``) and a fresh slot for every offloaded tensor in each
:class:`~vmstoolkit.exec.backends.cuda.CudaBackend`: a 16-block 4096-wide full fine-tuning step
(39 GB of weights and Adam moments) held 78 GB of host memory, and every new backend (every
repeat of :func:`~vmstoolkit.exec.experiment.sweep_budgets`, every step of a training loop)
page-locked tens of GB again, which takes seconds per 10 GB.

Approach. Two independent choices of the caller:

- ``pin``: how the caller's values (weights, inputs) become pinned.

  - ``"copy"`` (the default, as before): the backend pins a copy of each value; the caller's
    arrays are never touched. Host memory holds every value twice while a backend is open.
  - ``"in_place"``: a value that is not pinned yet is replaced *in the caller's dict* by a pinned
    copy of itself (the dict is mutated; the pageable original is freed when nothing else holds
    it). Later backends, and anything else reading the dict (a reference run), find the pinned
    arrays and copy nothing: one set of values, pinned once.
  - ``"register"``: the caller's own weights are page-locked where they are
    (``cuMemHostRegister``, flag ``PORTABLE``): no copy, the dict is not mutated. Copied into
    pooled slots instead, silently: inputs (a training loop hands in new ones every step;
    registering each would pin, and keep alive until the pool closes, one more array per step)
    and arrays smaller than :data:`REGISTER_MIN_BYTES` (a copy is cheaper); and with a one-line
    :class:`PinFallbackWarning` naming them: not C-contiguous (one DMA needs one range),
    read-only (the pages may be mapped read-only, which registration refuses without
    ``CU_MEMHOSTREGISTER_READ_ONLY`` and device support), of another dtype or shape than the
    tensor, or refused by the driver (the CUresult is named; e.g.
    ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` when a page is shared with a buffer registered
    elsewhere).

- ``pool``: a :class:`PinnedPool` that outlives one backend. Offload slots (and ``"copy"``'s
  copies, and fallback copies) are lent to a backend and given back when it closes; the next
  backend borrows the same slots, so a sweep pins its slots once. Registrations stay until the
  pool closes, so a caller registers once per sweep too. Without a pool each backend makes a
  private one and frees it on close (what it pinned is given back at once, not when numba's
  deferred deallocations next run).

Implementation. :class:`PinnedPool` keeps idle slots by exact byte size (a graph's tensors come
in a few sizes repeated per block, and one sweep runs one graph: exact sizes hit; another
sequence length misses and pins new slots, which :meth:`PinnedPool.trim` frees). It speaks to
the driver through a small :class:`HostMemory` interface, real (:class:`CudaHostMemory`) or
fake (the CPU tests count every allocation and registration), and counts what it holds in
:class:`PinnedStats`.

What the runtime writes. Tensors are write-once: a training step's AdamW writes the updated
weights and moments to *new* tensors (``{param}.new``), graph outputs living in slots, and the
compiler offloads only activations (weights and inputs already have a host copy). So the
runtime never writes a caller's value: with ``"in_place"`` or ``"register"``, every repeat of a
step starts from the same weights, as with ``"copy"``. :meth:`PinnedPool.place` checks this and
refuses an offload of a weight or input.

Limitations. A registered array is kept alive by the pool until :meth:`PinnedPool.close` (freeing
registered memory underneath the driver is undefined). Mutating a caller's array while a run is
in flight is the caller's race, in every mode but ``"copy"``. ``"in_place"`` and ``"register"``
keep the host memory of a sweep at one set of values plus the slots, and ``"copy"`` at two sets.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vmstoolkit.errors import InvalidFreeError, VmsError
from vmstoolkit.exec.errors import CudaCallError, ExecutionError, HostBudgetError, InvalidGraphError, InvalidOptionError
from vmstoolkit.exec.graph import TensorKind

PIN_MODES = ("copy", "in_place", "register")

# Arrays below this are copied into a pooled slot rather than registered. A registration is a
# driver call that walks and locks page tables (tens of microseconds at least), while copying
# 1 MiB costs about as much; and small arrays come from malloc's heap, where they share their
# first and last page with other objects, so registering two neighbours overlaps and the driver
# refuses the second. glibc serves blocks above its mmap threshold (128 KiB, raised dynamically
# up to 32 MiB) with mappings of their own; the weights that matter are tens of MiB.
REGISTER_MIN_BYTES = 1 << 20
# What a cuda.bindings call raises when the binding, not the driver, refuses its arguments or
# answers in an unexpected form (a CUresult is an answer, these are not).
BINDING_ERRORS = (TypeError, ValueError, AttributeError)


class PinFallbackWarning(VmsError, UserWarning):
    """``pin="register"`` copied some arrays instead of registering them (the message says which
    and why). A member of the error family, like every exception vmstoolkit defines (raised as
    one under ``warnings.simplefilter("error")``)."""


@dataclass
class PinnedStats:
    """What a :class:`PinnedPool` holds and has done. ``allocated_bytes`` are pinned bytes it
    owns now (slots, idle or lent); ``lent_bytes`` the part a backend holds; ``registered_bytes``
    caller bytes page-locked in place; ``in_place_bytes`` pinned arrays handed to callers (copies
    stored in their ``values`` or in a backend's ``host=`` dict: theirs, freed with the arrays).
    Over the pool's life: ``alloc_calls`` and ``register_calls`` count driver allocations and
    registrations, ``copied_bytes`` the bytes copied into pinned memory."""

    allocated_bytes: int = 0
    lent_bytes: int = 0
    registered_bytes: int = 0
    in_place_bytes: int = 0
    alloc_calls: int = 0
    register_calls: int = 0
    copied_bytes: int = 0


class HostMemory(Protocol):
    """Pinned host memory from a driver: the real one (:class:`CudaHostMemory`) or a test's fake."""

    def alloc(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of pinned memory as a uint8 array, freed when the array is collected."""

    def register(self, array: np.ndarray) -> None:
        """Page-lock ``array``'s bytes where they are; raises :class:`CudaCallError`."""

    def unregister(self, array: np.ndarray) -> None:
        """Undo :meth:`register`; raises :class:`CudaCallError`."""

    def is_pinned(self, array: np.ndarray) -> bool:
        """Whether ``array``'s first and last byte lie in pinned memory (allocated or registered)."""

    def flush(self) -> None:
        """Free now what was dropped (numba defers frees of pinned memory)."""


def _first_last(array: np.ndarray) -> tuple[int, int]:
    addr = array.__array_interface__["data"][0]
    return addr, addr + max(array.nbytes, 1) - 1


class CudaHostMemory:
    """:class:`HostMemory` of the CUDA driver in ``gpu``'s context: allocations by numba
    (``memhostalloc``, portable: pinned for every context, so any GPU's copies run at full
    speed), registrations by ``cuda.bindings`` (``cuMemHostRegister``, ``PORTABLE``), the
    pinned test by ``cuPointerGetAttribute(MEMORY_TYPE)`` (``HOST`` for allocated and registered
    memory; an error for pageable memory)."""

    def __init__(self, gpu: int = 0):
        self.gpu = gpu

    def alloc(self, nbytes: int) -> np.ndarray:
        from numba import cuda

        with cuda.gpus[self.gpu]:
            mem = cuda.current_context().memhostalloc(max(1, nbytes), mapped=False, portable=True)
        return np.ndarray((nbytes,), np.uint8, buffer=mem)

    def register(self, array: np.ndarray) -> None:
        from cuda.bindings import driver as cu
        from numba import cuda

        addr = array.__array_interface__["data"][0]
        try:
            with cuda.gpus[self.gpu]:
                (err,) = cu.cuMemHostRegister(addr, array.nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE)
        except BINDING_ERRORS as e:  # the binding, not the driver: the pool copies
            raise CudaCallError(type(e).__name__, f"cuMemHostRegister of {array.nbytes} bytes at {addr:#x}: {e}") from e
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaCallError(err.name, f"cuMemHostRegister of {array.nbytes} bytes at {addr:#x}", code=int(err))

    def unregister(self, array: np.ndarray) -> None:
        from cuda.bindings import driver as cu
        from numba import cuda

        addr = array.__array_interface__["data"][0]
        with cuda.gpus[self.gpu]:
            (err,) = cu.cuMemHostUnregister(addr)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaCallError(err.name, f"cuMemHostUnregister at {addr:#x}", code=int(err))

    def is_pinned(self, array: np.ndarray) -> bool:
        """Asks the driver; "no" when it cannot say. A "no" is always safe (the caller copies into
        pinned memory, or registration is refused and falls back to a copy), so a binding that
        answers in an unexpected form costs memory, with one warning, not the run."""
        from cuda.bindings import driver as cu
        from numba import cuda

        try:
            host = int(cu.CUmemorytype.CU_MEMORYTYPE_HOST)
            with cuda.gpus[self.gpu]:
                for addr in _first_last(array):
                    err, kind = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                         cu.CUdeviceptr(addr))
                    if err != cu.CUresult.CUDA_SUCCESS or int(kind) != host:
                        return False
        except BINDING_ERRORS as e:
            if not getattr(self, "_warned", False):
                self._warned = True
                warnings.warn(f"cannot ask the driver whether host memory is pinned ({type(e).__name__}: {e}); "
                              f"treating it as pageable: pinned copies are made", PinFallbackWarning, stacklevel=2)
            return False
        return True

    def flush(self) -> None:
        from numba import cuda

        with cuda.gpus[self.gpu]:
            cuda.current_context().deallocations.clear()


def _range(array: np.ndarray) -> tuple[int, int]:
    return array.__array_interface__["data"][0], array.nbytes


def _shaped(buf: np.ndarray, shape, dtype) -> np.ndarray:
    return buf.view(dtype).reshape(shape)


class PinnedPool:
    """Pinned host memory shared by successive CUDA backends (Note [Pinned host memory] above):
    offload slots lent to one backend at a time, registrations of caller arrays, counted in
    :attr:`stats`. Close it when the last backend using it has closed (``with PinnedPool() as
    pool:`` does): it unregisters what it registered and frees its slots; arrays it pinned in
    place belong to the caller and live on.

    ``memory``: the driver (default: :class:`CudaHostMemory` of GPU 0, made on first use, so a
    pool is built without a GPU). ``register_min_bytes``: :data:`REGISTER_MIN_BYTES`.
    ``limit_bytes``: a hard bound on the pinned slots it owns (:attr:`PinnedStats.allocated_bytes`,
    idle or lent; the host plan's ``staging`` figure, :func:`vmstoolkit.exec.host_plan.host_plan`):
    a slot that would pass it first frees idle slots, largest first, and if lent slots alone
    leave no room raises :class:`~vmstoolkit.exec.errors.HostBudgetError` in one line, before
    the driver is asked. None: unbounded (idle slots of other sizes are kept for reuse).

    >>> from vmstoolkit.exec.backends.cuda import CudaBackend  # doctest: +SKIP
    >>> with PinnedPool() as pool:  # doctest: +SKIP
    ...     for i in range(3):
    ...         be = CudaBackend(values, pin="register", pool=pool)  # registers once, slots once
    ...         execute(mg, be); be.close()
    """

    def __init__(self, memory: HostMemory | None = None, *, register_min_bytes: int = REGISTER_MIN_BYTES,
                 limit_bytes: int | None = None):
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                        or limit_bytes < 0):
            raise InvalidOptionError(f"limit_bytes={limit_bytes!r}: a whole number of bytes, at least 0, or None")
        self._memory = memory
        self.register_min_bytes = register_min_bytes
        self.limit_bytes = limit_bytes
        self.stats = PinnedStats()
        self._idle: dict[int, list[np.ndarray]] = {}  # byte size -> idle slot buffers (uint8)
        self._lent: dict[int, np.ndarray] = {}  # id(view handed out) -> its slot buffer
        self._registered: dict[tuple[int, int], np.ndarray] = {}  # (address, bytes) -> the array (kept alive)
        # (address, bytes) -> the pinned copy this pool handed out (weakly: it is the caller's): known
        # pinned without asking the driver, so in-place values are never copied twice even if the
        # driver's pointer query says otherwise
        self._copies: dict[tuple[int, int], weakref.ref] = {}
        self.closed = False

    @property
    def memory(self) -> HostMemory:
        if self._memory is None:
            self._memory = CudaHostMemory()
        return self._memory

    def __enter__(self) -> "PinnedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> None:
        if self.closed:
            raise InvalidOptionError("this PinnedPool is closed; make a new one")

    # -- slots ------------------------------------------------------------------------------

    def lend(self, shape, dtype) -> np.ndarray:
        """A pinned array of ``shape`` and ``dtype`` (contents undefined) for one backend until
        :meth:`give_back`: an idle slot of the same byte size, else a new allocation.
        Runtime complexity: O(1) (plus the driver's allocation on a miss)."""
        self._open()
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        idle = self._idle.get(nbytes)
        if idle:
            buf = idle.pop()
        else:
            self._make_room(nbytes)
            buf = self._alloc(nbytes)
            self.stats.allocated_bytes += nbytes
        view = _shaped(buf, shape, dtype)
        self._lent[id(view)] = buf
        self.stats.lent_bytes += nbytes
        return view

    def _make_room(self, nbytes: int) -> None:
        """Free idle slots, largest first, until a new ``nbytes`` slot fits :attr:`limit_bytes`."""
        if self.limit_bytes is None or self.stats.allocated_bytes + nbytes <= self.limit_bytes:
            return
        freed = 0
        for size in sorted(self._idle, reverse=True):
            bufs = self._idle[size]
            while bufs and self.stats.allocated_bytes + nbytes > self.limit_bytes:
                bufs.pop()
                self.stats.allocated_bytes -= size
                freed += size
            if not bufs:
                del self._idle[size]
        if freed and self._memory is not None:
            self._memory.flush()
        if self.stats.allocated_bytes + nbytes > self.limit_bytes:
            from vmstoolkit.units import format_size

            raise HostBudgetError(f"pinned staging needs {format_size(self.stats.allocated_bytes + nbytes)} "
                                  f"({format_size(self.stats.lent_bytes)} lent, a new {format_size(nbytes)} slot), "
                                  f"above its bound of {format_size(self.limit_bytes)} (the host plan's staging)")

    def _alloc(self, nbytes: int) -> np.ndarray:
        self.stats.alloc_calls += 1
        return self.memory.alloc(nbytes)

    def give_back(self, arrays) -> None:
        """Make slots from :meth:`lend` idle again (their contents are dead: copy out first).
        Raises :class:`~vmstoolkit.errors.InvalidFreeError` for an array this pool did not lend
        or that was given back already."""
        for a in arrays:
            buf = self._lent.pop(id(a), None)
            if buf is None:
                raise InvalidFreeError(f"a {a.nbytes}-byte array was not lent by this PinnedPool "
                                       f"(or was given back twice)")
            self.stats.lent_bytes -= buf.nbytes
            self._idle.setdefault(buf.nbytes, []).append(buf)

    def trim(self) -> int:
        """Free every idle slot (say, after a sweep at another sequence length); returns the
        bytes freed."""
        freed = sum(b.nbytes for bufs in self._idle.values() for b in bufs)
        self._idle.clear()
        self.stats.allocated_bytes -= freed
        if freed and self._memory is not None:
            self._memory.flush()
        return freed

    # -- caller values ----------------------------------------------------------------------

    def is_pinned(self, array: np.ndarray) -> bool:
        """Whether ``array`` is page-locked: registered or copied by this pool (known here), or
        else as the driver says."""
        key = _range(array)
        ref = self._copies.get(key)
        return key in self._registered or (ref is not None and ref() is not None) or self.memory.is_pinned(array)

    def register(self, array: np.ndarray) -> str | None:
        """Page-lock ``array`` where it is, until :meth:`close` (the pool keeps it alive); a
        second call for the same range (address and size) does nothing. Returns ``None``, or why it could not
        (the CUresult name and message)."""
        self._open()
        key = _range(array)
        if key in self._registered:
            return None
        try:
            self.memory.register(array)
        except CudaCallError as e:
            return str(e)
        self._registered[key] = array
        self.stats.register_calls += 1
        self.stats.registered_bytes += array.nbytes
        return None

    def pinned_copy(self, value: np.ndarray, shape=None, dtype=None) -> np.ndarray:
        """A pinned copy of ``value`` (as ``shape``/``dtype``, default its own) that belongs to
        the caller (freed with the array, not by the pool): what ``pin="in_place"`` stores."""
        self._open()
        dtype = np.dtype(value.dtype if dtype is None else dtype)
        shape = tuple(np.shape(value) if shape is None else shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        h = _shaped(self._alloc(nbytes), shape, dtype)
        h[...] = value
        self._copies[_range(h)] = weakref.ref(h)
        self.stats.in_place_bytes += nbytes
        self.stats.copied_bytes += nbytes
        return h

    def pin(self, values: dict, mode: str = "in_place") -> None:
        """Pin every array of ``values`` now, before any backend (so a reference run reads
        the same pinned arrays): ``"in_place"`` replaces each that is not pinned by a pinned
        copy (``values`` is mutated), ``"register"`` registers each that qualifies (the others
        are left for the backend to copy). Idempotent."""
        if mode not in ("in_place", "register"):
            raise InvalidOptionError(f"PinnedPool.pin mode must be 'in_place' or 'register', not {mode!r}")
        for k, v in values.items():
            v = np.asarray(v)
            if mode == "in_place":
                if not (v.flags.c_contiguous and self.is_pinned(v)):
                    values[k] = self.pinned_copy(v)
            elif _unregistrable(v, v.shape, v.dtype, self.register_min_bytes) is None and not self.is_pinned(v):
                self.register(v)

    # -- one backend's host arrays ----------------------------------------------------------

    def place(self, graph, offloaded, values: dict, pin: str, lent: list, legacy: dict | None = None) -> dict:
        """The host array of every weight and input of ``graph`` (from ``values`` as ``pin``
        says) and a slot for every tensor in ``offloaded`` (tensor ids), by tensor id. Slots
        lent are appended to ``lent`` as they are taken (the backend gives them back on close,
        even when this raises half-way). ``legacy``: the backend's old ``host=`` dict, consulted
        first and filled with pinned arrays it keeps (as before pools existed).

        Raises :class:`InvalidOptionError` for a value missing from ``values``, and
        :class:`InvalidGraphError` for an offload of a weight or input (the runtime writes only
        slots, never a caller's array). Warns :class:`PinFallbackWarning` once, naming the
        arrays ``"register"`` copied and why."""
        if pin not in PIN_MODES:
            raise InvalidOptionError(f"pin must be one of {', '.join(map(repr, PIN_MODES))}, not {pin!r}")
        self._open()
        arrays: dict[int, np.ndarray] = {}
        fallbacks: list[str] = []

        def slot(t) -> np.ndarray:
            s = self.lend(t.shape, t.dtype)
            lent.append(s)
            return s

        for t in graph.tensors:
            if t.kind is TensorKind.ACTIVATION:
                continue
            if legacy is not None and t.id in legacy:
                arrays[t.id] = legacy[t.id]
                continue
            if t.id not in values:
                raise InvalidOptionError(f"values lack {t.kind.value} {t.name!r} (tensor {t.id}): the CUDA backend "
                                         f"needs a host value of every weight and input")
            v = values[t.id]
            if pin == "copy":
                if legacy is not None:
                    h = legacy[t.id] = self.pinned_copy(v, t.shape, t.dtype)
                else:
                    h = slot(t)
                    h[...] = v
                    self.stats.copied_bytes += h.nbytes
            elif pin == "in_place":
                if _fits(v, t.shape, t.dtype) and self.is_pinned(v):
                    h = v
                else:
                    h = values[t.id] = self.pinned_copy(v, t.shape, t.dtype)
            else:
                why = _unregistrable(v, t.shape, t.dtype, self.register_min_bytes)
                if why is None and not self.is_pinned(v):
                    why = _INPUT if t.kind is TensorKind.INPUT else self.register(v)
                if why is None:
                    h = v
                else:
                    h = slot(t)
                    h[...] = v
                    self.stats.copied_bytes += h.nbytes
                    if why not in (_SMALL, _INPUT):
                        fallbacks.append(f"{t.name} ({why})")
            arrays[t.id] = h
        for tid in offloaded:
            t = graph.tensors[tid]
            if t.kind is not TensorKind.ACTIVATION:
                raise InvalidGraphError(f"the memory graph offloads {t.kind.value} {t.name!r}: the runtime writes "
                                        f"only host slots of activations, never a caller's array")
            if tid in arrays:
                continue
            if legacy is not None:
                if tid not in legacy:
                    legacy[tid] = _shaped(self._alloc(t.nbytes), t.shape, t.dtype)
                    self.stats.in_place_bytes += t.nbytes
                arrays[tid] = legacy[tid]
            else:
                arrays[tid] = slot(t)
        if fallbacks:
            k = _WARN_NAMES
            shown = ", ".join(fallbacks[:k]) + (f" and {len(fallbacks) - k} more" if len(fallbacks) > k else "")
            warnings.warn(f"pin='register' copied {len(fallbacks)} array(s) into pinned slots instead: {shown}",
                          PinFallbackWarning, stacklevel=3)
        return arrays

    # -- end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister every registered array and free every slot. Raises
        :class:`ExecutionError` while a backend still holds slots (the GPU may be copying into
        them: close the backends first). Idempotent; a failed unregistration is raised after
        the others are done."""
        if self.closed:
            return
        if self._lent:
            raise ExecutionError(f"PinnedPool.close(): {len(self._lent)} slot(s), {self.stats.lent_bytes} bytes, are "
                                 f"still lent to an open backend; close the backends first")
        errors = []
        for arr in self._registered.values():
            try:
                self.memory.unregister(arr)
            except CudaCallError as e:
                errors.append(e)
        self._registered.clear()
        self.stats.registered_bytes = 0
        self.trim()
        self.closed = True
        if errors:
            raise errors[0]

    def _check(self) -> None:
        """Assert the pool's invariants: byte counts equal the slots held, no slot is both idle
        and lent, every idle slot sits in its own size's list."""
        idle = [b for bufs in self._idle.values() for b in bufs]
        assert all(b.nbytes == n for n, bufs in self._idle.items() for b in bufs)
        assert not {id(b) for b in idle} & {id(b) for b in self._lent.values()}
        assert len({id(b) for b in idle}) == len(idle)
        assert self.stats.lent_bytes == sum(b.nbytes for b in self._lent.values())
        assert self.stats.allocated_bytes == self.stats.lent_bytes + sum(b.nbytes for b in idle)
        assert self.stats.registered_bytes == sum(a.nbytes for a in self._registered.values())


_SMALL = "small"  # reasons to copy by design, without a warning
_INPUT = "input"
_WARN_NAMES = 8  # arrays a PinFallbackWarning names; the count says how many more (the line stays short)


def _fits(v, shape, dtype) -> bool:
    return isinstance(v, np.ndarray) and v.flags.c_contiguous and v.dtype == np.dtype(dtype) and v.shape == tuple(shape)


def _unregistrable(v, shape, dtype, min_bytes: int) -> str | None:
    """Why ``v`` cannot be used in place as the tensor's host array with ``pin="register"``,
    or ``None``."""
    if not isinstance(v, np.ndarray):
        return f"a {type(v).__name__}, not a numpy array"
    if v.dtype != np.dtype(dtype) or v.shape != tuple(shape):
        return f"{v.dtype}{list(v.shape)}, the tensor is {np.dtype(dtype)}{list(shape)}"
    if not v.flags.c_contiguous:
        return "not C-contiguous"
    if not v.flags.writeable:
        return "read-only"
    if v.nbytes < min_bytes:
        return _SMALL
    return None
