"""Kernel tests run under the CUDA simulator (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 unless
VMSTOOLKIT_REAL_GPU=1) or, with VMSTOOLKIT_REAL_GPU=1, on a real GPU."""

import os
import sys

# helper modules of these tests (ptx_probe) by name: --import-mode=importlib (pyproject.toml)
# puts no test folder on sys.path
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Same default as tests/conftest.py, for runs of this folder alone; without effect if numba.cuda
# was already imported (the autouse fixture below then skips with the reason).
if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from vmstoolkit.kernels._util import simulating  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_backend():
    if not simulating() and not cuda.is_available():
        pytest.skip(
            "numba.cuda was imported before NUMBA_ENABLE_CUDASIM=1 was set and no GPU is "
            "present: run with NUMBA_ENABLE_CUDASIM=1 (or VMSTOOLKIT_REAL_GPU=1 on a GPU)"
        )


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _rel_err(got, want) -> float:
    """Max abs difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(np.asarray(got) - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.fixture
def rel_err():
    return _rel_err
