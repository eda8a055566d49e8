"""Every backend speaks one protocol (close() included), and the CUDA backend's region comes
from the allocator it is given, checked by the registry (issue 19: no probing, no "vms" hard-coded)."""

import pytest

from tests.exec.helpers import TINY
from vmstoolkit.errors import ConfigError
from vmstoolkit.exec.backends.base import Backend
from vmstoolkit.exec.backends.cuda import CudaBackend, take_region
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.experiment import run_offload_experiment


@pytest.mark.parametrize("make", [SimBackend, lambda: CudaBackend({})], ids=["sim", "cuda"])
def test_every_backend_speaks_the_protocol(make):
    be = make()
    assert isinstance(be, Backend)  # setup, clock, launch, completion, drive, result, close


def test_sim_close_is_a_no_op_that_may_be_called_twice():
    be = SimBackend()
    be.close()
    be.close()


def test_the_experiment_closes_every_backend_it_makes(monkeypatch):
    closed = []
    monkeypatch.setattr(SimBackend, "close", lambda self: closed.append(self))
    rows = run_offload_experiment("sim", config=TINY, fractions=(1.0, 0.5), repeats=2)
    assert len(closed) == len(rows) * 2 and len({id(b) for b in closed}) == len(closed)


def test_cuda_backend_refuses_an_unknown_allocator_without_a_gpu():
    with pytest.raises(ConfigError, match="'nope'"):
        CudaBackend({}, allocator="nope")
    with pytest.raises(ConfigError, match="bogus"):
        CudaBackend({}, allocator="vms", allocator_options={"bogus": 1})
    assert CudaBackend({}).allocator == "vms"


@pytest.mark.parametrize("allocator,creates", [("vms", 32), ("native", 1)])
def test_the_region_comes_from_the_allocator_given(monkeypatch, allocator, creates):
    """``take_region`` over the simulated driver in place of the real one: the allocator named
    is the one that serves the region (vms creates one 2 MiB chunk at a time, native one
    allocation of the whole size)."""
    import vmstoolkit.pools.drivers as drivers

    made = []
    real = drivers.make_driver

    def sim_driver(kind, device=0, peers=()):
        assert kind == "cuda"
        made.append(real("sim", capacity=1 << 30))
        return made[-1]

    monkeypatch.setattr(drivers, "make_driver", sim_driver)
    addr, release = take_region(0, 64 << 20, allocator=allocator)
    assert addr and made[0].calls["create"] == creates
    release()
    assert made[0].physical_bytes == 0
