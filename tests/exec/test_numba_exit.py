"""The exit guard against numba-cuda unloading a kernel library once per GPU."""

import os
import subprocess
import sys
import textwrap
import weakref

from vmstoolkit.exec.backends import numba_exit
from vmstoolkit.exec.backends.numba_exit import NUMBA_DRIVER_MODULE, detach_duplicate_unloads


def _module_finalizer(handle, unloaded):
    """Shaped like numba-cuda's: a closure ``core(key=handle)`` defined in its driver module."""

    def core(key=handle):
        unloaded.append(key)

    core.__module__ = NUMBA_DRIVER_MODULE
    return core


class _Module:
    pass


def test_each_library_handle_is_unloaded_once_and_other_finalizers_are_left_alone():
    unloaded, other = [], []
    modules = [_Module() for _ in range(4)]
    fins = [weakref.finalize(modules[0], _module_finalizer(7, unloaded)),  # GPU 0's module of library 7
            weakref.finalize(modules[1], _module_finalizer(7, unloaded)),  # GPU 1's module of the same library
            weakref.finalize(modules[2], _module_finalizer(8, unloaded)),
            weakref.finalize(modules[3], lambda: other.append("x"))]
    assert detach_duplicate_unloads() == 1
    assert [f.alive for f in fins] == [True, False, True, True]
    assert detach_duplicate_unloads() == 0  # nothing left to detach
    for f in fins:
        f()
    assert sorted(unloaded) == [7, 8] and other == ["x"]


def test_the_guard_runs_before_the_finalizers_at_exit():
    script = textwrap.dedent(f"""
        import weakref
        from vmstoolkit.exec.backends.numba_exit import guard_library_unload

        def _module_finalizer(handle):
            def core(key=handle):
                print("unload", key, flush=True)
            core.__module__ = {NUMBA_DRIVER_MODULE!r}
            return core

        class M: pass
        keep = [M() for _ in range(5)]
        for m, h in zip(keep, (3, 3, 4, 3, 4)):
            weakref.finalize(m, _module_finalizer(h))
        guard_library_unload()
        guard_library_unload()  # idempotent
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert sorted(out.stdout.split("\n")[:-1]) == ["unload 3", "unload 4"]


def test_numba_cudas_real_module_finalizer_is_recognised():
    """Against the installed numba-cuda (its real driver module, not the simulator): if a new
    release renames or reshapes the finalizer, this fails and the guard needs a look."""
    script = textwrap.dedent("""
        import types
        from numba.cuda.cudadrv import driver
        from vmstoolkit.exec.backends.numba_exit import _library_key
        ctx = types.SimpleNamespace(deallocations=None, modules={})
        core = driver._module_finalizer(ctx, types.SimpleNamespace(handle=1234))
        print(_library_key(core))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1234"


def test_other_callables_are_not_library_finalizers():
    assert numba_exit._library_key(len) is None
    assert numba_exit._library_key(lambda: None) is None
