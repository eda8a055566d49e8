"""Unload each of numba-cuda's kernel libraries once at exit, when several GPUs share them.

numba-cuda 0.30 loads a kernel's code as one context-independent CUDA library
(``cuLibraryLoadData``, a cuda.core ``ObjectCode``) and reuses it in the context of every GPU of
the same compute capability, but each context's module gets its own finalizer, and every one of
them calls ``cuLibraryUnload`` on the same library handle. At interpreter exit the second
unload of a handle crashes the process (a segmentation fault, or glibc's "double free or
corruption"), after all the work is done. Measured on ``nvidia-h200-x2`` with numba-cuda 0.30.4
and nothing of vmstoolkit loaded: 16 kernels launched on both GPUs, then exit, crashes every
time; one GPU exits cleanly (``docs/results.md#offload-h200``, run 6).
``numba.cuda.close()`` crashes the same way while it resets the contexts. The crash of
``cuLibraryUnload`` under numba-cuda is reported upstream (NVIDIA/cuda-python issue 1670).

:func:`guard_library_unload` registers an exit handler that runs before the finalizers and
detaches every module finalizer but the first of each library handle, so that each library is
unloaded exactly once. The multi-GPU paths of the CUDA backend install it.
"""

from __future__ import annotations

import atexit
import weakref

NUMBA_DRIVER_MODULE = "numba.cuda.cudadrv.driver"
MODULE_FINALIZER = "_module_finalizer.<locals>.core"

_installed = False


def _library_key(func) -> object | None:
    """The library handle a numba module finalizer unloads, or ``None`` if ``func`` is not one."""
    if getattr(func, "__module__", None) != NUMBA_DRIVER_MODULE or getattr(func, "__qualname__", None) != MODULE_FINALIZER:
        return None
    defaults = getattr(func, "__defaults__", None) or ()
    if not defaults:
        return None
    handle = defaults[0]  # ``core(key=object_code.handle)``
    try:
        return int(handle)
    except (TypeError, ValueError):
        return handle


def detach_duplicate_unloads() -> int:
    """Detach the module finalizers that would unload an already unloaded library; returns how many."""
    registry = getattr(weakref.finalize, "_registry", {})
    seen: set = set()
    detached = 0
    for fin in list(registry):
        peeked = fin.peek()
        if peeked is None:  # already called or detached
            continue
        key = _library_key(peeked[1])
        if key is None:
            continue
        if key in seen:
            fin.detach()
            detached += 1
        else:
            seen.add(key)
    return detached


def guard_library_unload() -> None:
    """Install :func:`detach_duplicate_unloads` to run at exit, before the finalizers (once)."""
    global _installed
    if _installed:
        return
    # atexit runs handlers last-registered first; weakref registers its exit hook with the first
    # finalize object, so make sure it exists before registering ours.
    weakref.finalize(_installed_marker, lambda: None)
    atexit.register(detach_duplicate_unloads)
    _installed = True


class _Marker:
    pass


_installed_marker = _Marker()
