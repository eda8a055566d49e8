"""Test-wide setup. Numba kernels run under the CUDA simulator unless VMSTOOLKIT_REAL_GPU=1."""

import os

if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Tables fit the terminal (rich reads COLUMNS): one fixed width, whatever runs the tests (a TTY,
# CI, pytest-xdist's workers); tests of narrow terminals pass their own.
os.environ["COLUMNS"] = "160"
# One BLAS thread a process (numpy's OpenBLAS, and whatever these processes start): the suite runs
# a process per core already (pytest-xdist), and OpenBLAS's extra threads spin while they wait
# for work: on 2 shared cores tests/cli/test_train_offload_cli.py took 23.7 s of CPU with them,
# 5.5 s without. Set before numpy is imported (nothing imports it before this file); a value
# the caller set is kept.
for _blas in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_blas, "1")

from pathlib import Path  # noqa: E402

from hypothesis import Phase, settings  # noqa: E402

# Hypothesis without its explain phase: on a failing property test of paged (a program of a few
# hundred steps over the compiled heap's arrays) the phase, which reruns the shrunk example with
# every part varied to report which parts matter, held 18.5 GB of RSS for one test (measured with
# a failure injected into test_paged.py's random programs), where the suite's limit is 3 GB a
# worker. The failing example is still found, shrunk and printed.
settings.register_profile("vmstoolkit", phases=[p for p in Phase if p is not Phase.explain])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vmstoolkit"))

import pytest  # noqa: E402

TRACES = Path(__file__).resolve().parent.parent / "vmstoolkit" / "data" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return TRACES


_BUNDLED: dict = {}


@pytest.fixture(scope="session")
def bundled_trace():
    """:func:`_bundled_trace`."""
    return _bundled_trace


def _bundled_trace(path):
    """``load_trace(path)`` of a bundled trace, loaded once a process (each load of the LoRA trace
    costs about 0.25 s of CPU, and some 30 tests replay the bundled traces). A :class:`Trace` is
    frozen; its event columns are made read-only here, so a test or replay that wrote into a
    shared one would fail rather than change what the next test reads. For a test of loading
    itself, call ``load_trace``."""
    import numpy as np

    from vmstoolkit.trace import load_trace

    key = Path(path).resolve()
    assert key.parent.name == "traces" and key.parent.parent.name == "data", f"{path} is not a bundled trace"
    t = _BUNDLED.get(key)
    if t is None:
        t = _BUNDLED[key] = load_trace(key)
        for name in ("action", "addr", "size", "stream", "time_us"):
            col = getattr(t.events, name, None)
            if isinstance(col, np.ndarray):
                col.flags.writeable = False
    return t


def _warm_compiled_code() -> None:
    """Compile (or load from the user cache) the package's disk-cached compiled functions once,
    before any test and before pytest-xdist starts its workers, so that no worker, subprocess or
    Dask worker compiles them again: cold, each process paid about 24 s of CPU (the snapshot
    scanner, the compiled simulated driver, paged's heap and replay); warm, about 2 s. The
    scanner (about half of it) compiles in a second process meanwhile, on the other core."""
    import subprocess
    import sys

    scanner = subprocess.Popen([sys.executable, "-c", "import sys; from vmstoolkit.trace import load_trace; "
                                "load_trace(sys.argv[1])", str(TRACES / "llama-full.caching.pickle.gz")])
    from vmstoolkit.pools import make_allocator
    from vmstoolkit.trace.replay import replay
    from vmstoolkit.trace.synthetic import synthetic_trace

    short = synthetic_trace("full", steps=1)
    for name in ("paged", "native"):
        a = make_allocator(name, capacity=16 << 30)
        replay(short, a)
        a.close()
    scanner.wait()  # its exit status does not matter: a test that needs the scanner compiles it


def _simulator_without_busy_wait() -> None:
    """The CUDA simulator's blocks run on kept threads with a counting barrier instead of a new
    thread per CUDA thread and a polling loop (``tests/cudasim_barrier.py``), Numba's scalar
    casts without their per-call import and, in a launched module, as numpy's constructors
    (``tests/cudasim_casts.py``), device functions called without the module swap's locks
    (``tests/cudasim_device_calls.py``), shared arrays without a traceback per call
    (``tests/cudasim_shared.py``), in-kernel indexing without the wrappers' calls
    (``tests/cudasim_arrays.py``); the simulation itself unchanged (checked by
    ``tests/kernels/test_simulator_barrier.py``). Together they took tests/kernels from 46 s of
    CPU (summed over its tests, under -n auto on 2 cores) to 19."""
    import importlib.util

    for name in ("cudasim_barrier", "cudasim_casts", "cudasim_device_calls", "cudasim_shared", "cudasim_arrays"):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.install()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the usable cores. Many tests wait on other processes (the
    CLI's subprocesses, Dask clusters, notebook kernels, pip in the install test), and one more
    worker keeps the cores busy meanwhile: the whole suite on 2 cores took 162 s of wall time with
    2 workers and 144 s with 3 (the same with 4), at the same CPU time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores + 1


def pytest_configure(config):
    if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        _simulator_without_busy_wait()  # in every process that runs tests
    if not hasattr(config, "workerinput") and os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
        _warm_compiled_code()  # in xdist's controller, or the one process without xdist


@pytest.fixture(autouse=True)
def _reset_global_state():
    """Every test starts from the process's initial global state, as RMM's suite resets its
    current resource: the registry's allocators, the PyTorch hook installed (``_INSTALLED``,
    ``_POOL_HANDLES``), the compiled hook's device table and its one active hook. A test that
    leaves any of them changed (a failing test that never reached its uninstall, say) cannot
    leak it into the next. Modules not imported yet are not imported here."""
    import sys

    from vmstoolkit.pools import registry

    registered = dict(registry._REGISTRY)
    yield
    if registry._REGISTRY != registered:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(registered)
    torch_mod = sys.modules.get("vmstoolkit.integrations.torch")
    if torch_mod is not None:
        torch_mod._INSTALLED = None
        torch_mod._POOL_HANDLES.clear()
    native = sys.modules.get("vmstoolkit.integrations.native_torch")
    if native is not None:
        hook = native.NativeHook._active
        if hook is not None:
            try:
                hook.close()
            finally:
                native.NativeHook._active = None
        native.TABLE[:] = 0
