"""``njit`` whose on-disk cache lives in the user's cache folder, never in the install folder.

Numba's ``cache=True`` writes its index and object files beside the source, into the package's
own ``__pycache__`` (site-packages, for a normal install). pip does not know those files: after
``pip uninstall`` the folder stays behind as an empty namespace package that shadows a later
editable install, and on a read-only install with no writable home the decorator itself fails
(``cannot cache function '_bucket': no locator available``). The package must never write into
its install folder and must survive a reinstall, an upgrade and a read-only site-packages, so
every compiled function of the package is declared with :func:`njit` from here, and its cache
goes to, in this order:

1. ``$VMSTOOLKIT_CACHE_DIR`` (``off`` or an empty value: no disk cache at all);
2. ``$NUMBA_CACHE_DIR`` (Numba's own setting), when set;
3. ``$XDG_CACHE_HOME/vmstoolkit`` or ``~/.cache/vmstoolkit``.

Below the root, one folder per content of the package: ``numba/<version>-<digest>/<subpackage>``,
where the digest covers every ``.py`` file of the installed package. Two installs of the same
sources (``pip install .`` and ``pip install -e .`` of one checkout, the test that installs the
package into a fresh virtual environment) share the compiled code; any change to any module, so
also to a constant or a compiled function that another module's compiled code reads (Numba
freezes both at compile time, and its own in-tree cache checks only the caller's file), gets a
fresh folder. Old folders are never read again; delete the root to reclaim the space. When the
folder cannot be made or written, the function compiles on first use in every process, as with
``cache=False``: slower, never an error.

How: the dispatcher's cache object is a :class:`numba.core.caching.FunctionCache` whose
implementation tries only :class:`_UserCacheLocator`, the hook Numba provides for targets with
their own caches (``CacheImpl._locator_classes``); Numba's in-tree locator is never consulted.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from numba import njit as _numba_njit
from numba.core import caching as _caching
from numba.core import config as _numba_config

ENV = "VMSTOOLKIT_CACHE_DIR"
_OFF = ("", "off", "0", "none")


def cache_root() -> Path | None:
    """The folder compiled functions are cached under, or None when caching is off (see the module
    docstring for the order). It may not exist yet, or be unwritable: then nothing is cached."""
    if ENV in os.environ:
        v = os.environ[ENV].strip()
        return None if v.lower() in _OFF else Path(v).expanduser()
    if _numba_config.CACHE_DIR:
        return Path(_numba_config.CACHE_DIR)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg else Path("~").expanduser() / ".cache"
    if not base.is_absolute():  # `~` unresolvable (no HOME, no passwd entry), or a relative XDG
        return None
    return base / "vmstoolkit"


PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def package_digest(package: Path = PACKAGE) -> str:
    """``<version>-<hash of every .py file of the package, by relative path>``: the name of the
    folder the package's compiled code is cached in. Once per process (about 5 ms)."""
    from vmstoolkit._version import __version__

    h = hashlib.sha256()
    for p in sorted(package.rglob("*.py")):
        h.update(p.relative_to(package).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return f"{__version__}-{h.hexdigest()[:16]}"


class _UserCacheLocator(_caching._SourceFileBackedLocatorMixin, _caching._CacheLocator):
    """Numba's cache locator protocol, rooted at :func:`cache_root`, one folder per package content
    (:func:`package_digest`) and subpackage; a file outside the package gets Numba's folder name."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        src = Path(py_file).resolve()
        if src.is_relative_to(PACKAGE):
            sub = Path("numba", package_digest(), *src.parent.relative_to(PACKAGE).parts)
        else:
            sub = Path("numba", self.get_suitable_cache_subpath(py_file))
        self._cache_path = str(cache_root() / sub)

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        if cache_root() is None:
            return None
        # The mixin checks the source exists and makes and test-writes the folder (None on OSError).
        return super().from_function(py_func, py_file)


class _CacheImpl(_caching.CompileResultCacheImpl):
    _locator_classes = [_UserCacheLocator]


class _FunctionCache(_caching.FunctionCache):
    _impl_class = _CacheImpl


def enable_cache(dispatcher) -> bool:
    """Give a Numba CPU dispatcher the user-folder cache; False (and no cache) when no folder is
    usable. Numba's ``enable_caching`` does the same assignment with its in-tree cache."""
    try:
        dispatcher._cache = _FunctionCache(dispatcher.py_func)
    except RuntimeError:  # "no locator available": nothing writable, so compile in memory only
        return False
    return True


def njit(*args, cache: bool = False, **options):
    """``numba.njit``, with ``cache=True`` meaning the cache of this module. Used exactly like
    Numba's: ``@njit``, ``@njit(cache=True, inline="always")``, ``@njit(signature, ...)``."""
    if len(args) == 1 and callable(args[0]) and not options:
        return njit(cache=cache)(args[0])

    def decorate(fn):
        dispatcher = _numba_njit(**options)(fn)  # lazy: the cache is in place before any compile
        if cache:
            enable_cache(dispatcher)
        for sig in args[0] if args and isinstance(args[0], list) else args:
            dispatcher.compile(sig)
        return dispatcher

    return decorate
