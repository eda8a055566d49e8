"""The fast launch path's CPU cases (``fast_launch_cases.py``), in a process without Numba's CUDA
simulator: it replaces numba.cuda's driver modules (``DeviceNDArray``, ``_Kernel``), and the
cases compare against the real ones. They need no GPU."""

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("fast_launch_cases.py")


def test_fast_launch_cases_without_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(CASES)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
