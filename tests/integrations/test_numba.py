"""The Numba integration's handle (``install``), outside Numba's CUDA simulator (which has no
external memory management), with the simulated driver and stand-in contexts."""

import os
import subprocess
import sys
import textwrap

import pytest

from vmstoolkit.errors import VmsError


def test_install_under_the_simulator_says_why_not(monkeypatch):
    from vmstoolkit.integrations import numba as vn

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    with pytest.raises(VmsError, match="simulator"):
        vn.install("vms")


def test_the_handle_finds_each_devices_allocator_through_its_context():
    code = textwrap.dedent("""
        import logging
        import numba.cuda.cudadrv.driver as numba_driver
        if not hasattr(numba_driver, "_logger"):  # defined when Numba initialises a real driver
            numba_driver._logger = logging.getLogger("numba.cuda.cudadrv.driver")
        from numba import cuda
        import vmstoolkit.integrations.numba as vn
        from vmstoolkit.errors import ConfigError, VmsError
        from vmstoolkit.pools import make_driver
        vn.make_driver = lambda kind, device=0: make_driver("sim", capacity="64MiB")
        try:
            vn.install("nope")
        except ConfigError as e:
            assert "unknown allocator 'nope'" in str(e), e
        else:
            raise AssertionError("a bad name was installed")
        h = vn.install("gmlake")
        assert numba_driver._memory_manager is h.manager

        class Device:
            def __init__(self, i):
                self.id = i

        class Context:
            def __init__(self, i, manager):
                self.device = Device(i)
                self.memory_manager = manager(context=self)

        contexts = {0: Context(0, h.manager), 1: Context(1, h.manager),
                    2: Context(2, numba_driver.NumbaCUDAMemoryManager)}
        current = [1]
        cuda.current_context = lambda devnum=None: contexts[current[0] if devnum is None else devnum]
        p = contexts[0].memory_manager.memalloc(3 << 20)
        assert h.stats(0)["allocated_bytes.all.current"] == 3 << 20
        assert h.memory_stats(0)["allocated_bytes.all.current"] == 3 << 20
        assert h.stats()["allocated_bytes.all.current"] == 0  # the current device: 1
        assert h.allocator(0) is not h.allocator(1) and h.allocator(0).driver.capacity == 64 << 20
        h.allocator(0)._check()
        try:
            h.stats(2)
        except VmsError as e:
            assert "device 2's Numba context was made before" in str(e), e
        else:
            raise AssertionError("a context made before install was not reported")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
