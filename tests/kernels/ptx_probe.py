"""Helper of the offline-PTX tests (not a test module): run a script that compiles real (not
simulated) kernels to sm_90 PTX in a subprocess without ``NUMBA_ENABLE_CUDASIM``, after a prelude
that prints ``NO-TOOLKIT`` and exits where NVVM or NVRTC is missing and names a cc 9.0 device for
device functions (which compile for the current device's cc) where no driver is. Imported by
name (pytest puts this folder on sys.path)."""

import os
import subprocess
import sys

import pytest

PRELUDE = r"""
import sys
from numba import cuda, types
from numba.cuda import dispatcher
try:
    cuda.compile_ptx(lambda a: None, (types.float32[:],), cc=(9, 0))
except Exception as e:  # no NVVM / NVRTC here
    print("NO-TOOLKIT", type(e).__name__, str(e).splitlines()[0][:200])
    sys.exit(0)
class _Device:  # device functions compile for the current device's cc: name one without a driver
    compute_capability = (9, 0)
dispatcher.get_current_device = lambda: _Device()
"""


def run(body: str) -> str:
    """The stdout of PRELUDE + ``body``; skips the test where the toolkit is missing."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if "NO-TOOLKIT" in r.stdout:
        pytest.skip(f"no CUDA toolkit to compile PTX with: {r.stdout.strip()}")
    return r.stdout
