"""The CUDA kernel cache's keys, on the CPU (loading a cached kernel needs a GPU:
``tests/gpu/test_cuda_cache_gpu.py``): where a kernel's cache lives, that a generated kernel is
found by its source's hash, and that the cache is off unless asked for."""

from pathlib import Path

from vmstoolkit import _jit
from vmstoolkit.kernels import _cuda_cache as C
from vmstoolkit.kernels import _util


def test_generated_sources_are_named_by_their_content():
    a, b = C.generated_name("def kernel(): pass\n"), C.generated_name("def kernel(): return\n")
    assert a.startswith(C.GENERATED) and a != b and a == C.generated_name("def kernel(): pass\n")


def test_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(_jit.ENV, str(tmp_path))
    want = tmp_path / "numba" / _jit.package_digest() / "cuda"
    assert C.cache_folder(C.generated_name("x")) == want
    assert C.cache_folder(str(Path(C.__file__))) == want  # a module of the package
    assert C.cache_folder("/elsewhere/user_kernels.py") is None  # not ours: Numba's own rules
    monkeypatch.setenv(_jit.ENV, "off")
    assert C.cache_folder(C.generated_name("x")) is None


def test_off_by_default_and_the_file_name_follows(monkeypatch):
    monkeypatch.delenv(C.ENV, raising=False)
    assert not C.enabled()
    fn = _util.generated_function("def kernel():\n    return 1\n", "<label>", {})
    assert fn.__code__.co_filename == "<label>" and fn() == 1
    monkeypatch.setenv(C.ENV, "1")
    assert C.enabled()
    fn = _util.generated_function("def kernel():\n    return 2\n", "<label>", {})
    assert fn.__code__.co_filename == C.generated_name("def kernel():\n    return 2\n") and fn() == 2


def test_the_simulator_is_never_cached(monkeypatch):
    from numba import cuda

    monkeypatch.setenv(C.ENV, "1")
    k = cuda.jit(lambda a: None)
    before = getattr(k, "_cache", None)
    assert C.cached(k) is k and getattr(k, "_cache", None) is before


_LOCATOR_PROBE = r"""
import sys
from pathlib import Path
from vmstoolkit import _jit
from vmstoolkit.kernels import _cuda_cache as C, _util
cache_cls = C._classes()
assert cache_cls is not None, "numba-cuda's CUDACache / CUDACacheImpl are gone: cached() would leave every kernel uncached"
src = "def kernel(a):\n    a[0] = 1\n"
cache = cache_cls(_util.generated_function(src, "<x>", {}))
print(cache._cache_path)
print(cache._impl.locator.get_source_stamp() == C.generated_name(src)[len(C.GENERATED):])
print(_jit.package_digest())
"""


def test_numba_cuda_takes_the_locator(tmp_path):
    """numba-cuda's own cache class (the real one: a process without the simulator; no GPU needed
    to build it) with this locator, for a generated kernel: its index goes to the digest folder,
    stamped by the source's hash (an edited generator misses, a rerun hits)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update({_jit.ENV: str(tmp_path), C.ENV: "1"})
    r = subprocess.run([sys.executable, "-c", _LOCATOR_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    path, stamped, digest = r.stdout.split()
    assert Path(path) == tmp_path / "numba" / digest / "cuda" and stamped == "True"
