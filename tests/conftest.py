"""Test-wide setup. Numba kernels run under the CUDA simulator unless VMSTOOLKIT_REAL_GPU=1."""

import os

if os.environ.get("VMSTOOLKIT_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Tables fit the terminal (rich reads COLUMNS): one fixed width, whatever runs the tests (a TTY,
# CI, pytest-xdist's workers); tests of narrow terminals pass their own.
os.environ["COLUMNS"] = "160"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TRACES = Path(__file__).resolve().parent.parent / "vmstoolkit" / "data" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return TRACES
