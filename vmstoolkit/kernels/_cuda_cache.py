"""CUDA kernels kept across processes in the user's cache folder (:mod:`vmstoolkit._jit` does the
same for the CPU's compiled code).

A fresh process of ``vmstoolkit run generate`` on a 7B-shaped checkpoint spent 44 s of its 51 s
to the first row compiling kernels (``experiments/results/run-model-h200``): Numba compiles every
kernel again in every process. numba-cuda can cache a kernel on disk (``cuda.jit(cache=True)``),
but not these:

- most kernels (the GEMMs, flash attention) are *generated*: their source is built from the tile
  constants and ``exec``'d, so there is no source file, which Numba's cache locators require;
- Numba's own cache sits beside the source (the install folder) and checks only the kernel's own
  file's time stamp, while a kernel freezes device functions and constants of other modules: a
  change there would load a stale kernel.

So :func:`cached` gives a CUDA dispatcher a cache whose locator is keyed like ``_jit.py``'s: the
folder is ``<cache root>/numba/<package digest>/cuda`` (the digest covers every ``.py`` file of
the package: any change to any module gets a fresh folder), and a generated kernel, compiled
under the file name ``vmstoolkit-generated-<hash of its source>`` by
:func:`._util.generated_function`, is found by that hash. Within one folder Numba's index keys
each entry by signature, compute capability and compiler.

**Off by default** (``VMSTOOLKIT_CUDA_CACHE=1`` turns it on) until a GPU run has shown a second
process loading every kernel from the cache with the same results. So far one has shown it for
two generated kernels (H100, 2026-12-07, ``tests/gpu/test_cuda_cache_gpu.py``: the bf16 GEMM and
flash attention, bit-equal results, the second process in under a third of the first's time;
``experiments/results/kernels-h200/run11-h100``); a whole model's kernels, run twice with the
cache on, are next.
Whatever goes wrong while setting a cache up (no writable folder, a numba-cuda without these
classes) leaves the kernel uncached, compiled in every process as before.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vmstoolkit._jit import PACKAGE, cache_root, package_digest

ENV = "VMSTOOLKIT_CUDA_CACHE"
GENERATED = "vmstoolkit-generated-"  # the file name prefix of generated kernel sources


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip() == "1"


def generated_name(source: str) -> str:
    """The file name a generated source compiles under: its content's hash (16 hex digits)."""
    return GENERATED + hashlib.sha256(source.encode()).hexdigest()[:16]


def cache_folder(py_file: str) -> Path | None:
    """Where a kernel from ``py_file`` is cached: under the package's digest folder for the
    package's files and generated sources; None for anything else, or with caching off."""
    root = cache_root()
    if root is None:
        return None
    generated = Path(py_file).name.startswith(GENERATED)
    if not generated:
        try:
            if not Path(py_file).resolve().is_relative_to(PACKAGE):
                return None
        except OSError:
            return None
    return root / "numba" / package_digest() / "cuda"


def _classes():
    """numba-cuda's cache classes with this module's locator, or None where they differ."""
    try:
        from numba.cuda.core import caching
        from numba.cuda.dispatcher import CUDACache, CUDACacheImpl
    except ImportError:
        return None

    class Locator(caching._CacheLocator):
        def __init__(self, folder: Path, stamp: str):
            self._folder = str(folder)
            self._stamp = stamp

        def get_cache_path(self):
            return self._folder

        def get_source_stamp(self):
            return self._stamp  # the package digest or the generated source's hash: content, not time

        def get_disambiguator(self):
            return self._stamp[:16]

        @classmethod
        def from_function(cls, py_func, py_file):
            folder = cache_folder(py_file)
            if folder is None:
                return None
            name = Path(py_file).name
            stamp = name[len(GENERATED):] if name.startswith(GENERATED) else package_digest()
            self = cls(folder, stamp)
            try:
                self.ensure_cache_path()
            except OSError:
                return None
            return self

    class Impl(CUDACacheImpl):
        _locator_classes = [Locator]

    class Cache(CUDACache):
        _impl_class = Impl

    return Cache


_CACHE = None


def cached(dispatcher):
    """``dispatcher`` (a ``cuda.jit`` kernel) with the cache above when :func:`enabled`; the same
    dispatcher, uncached, otherwise or where no cache can be set up."""
    global _CACHE
    from numba.cuda.core import config

    if not enabled() or config.ENABLE_CUDASIM:
        return dispatcher
    if _CACHE is None:
        _CACHE = _classes() or False
    if not _CACHE:
        return dispatcher
    try:
        dispatcher._cache = _CACHE(dispatcher.py_func)
    except (RuntimeError, OSError):  # no locator: nothing writable
        pass
    return dispatcher
