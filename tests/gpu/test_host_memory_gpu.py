"""On a real GPU only (skipped elsewhere): the CUDA backend's host memory (issue 17;
``vmstoolkit/exec/backends/host_memory.py``). ``pin="in_place"`` and ``pin="register"`` keep one
set of values in host memory where the default ``"copy"`` holds two; two backends in a row on one
``PinnedPool`` borrow the same slots and pin nothing new; every mode gives the default path's
results; the product's sweeps run on a shared pool.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_host_memory_gpu.py -q

The CPU twin (``tests/exec/test_host_memory.py``) runs the same logic on the CUDA simulator with
a fake of pinned memory; here ``cuMemHostAlloc``, ``cuMemHostRegister`` and
``cuPointerGetAttribute`` are the driver's own.
"""

import os

import numpy as np
import pytest

from tests.exec.helpers import TINY, weighted_chain
from tests.gpu.test_real_gpu import _gpu

SHAPE = (2048, 8192)  # 64 MiB a tensor: host-memory changes of hundreds of MiB, far above RSS noise
N_WEIGHTS = 8  # 512 MiB of weights, plus a 64 MiB input

pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


def rss() -> int:
    """Resident bytes of this process (pinned pages included)."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def case():
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.graph import random_weights

    g = weighted_chain(N_WEIGHTS, SHAPE)
    values = random_weights(g, 0)
    mg = compile_memory_graph(g, working_set(g) // 2)
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0
    default = run(mg, CudaBackend(values))[0]  # also warms up: context, kernels, VMM driver
    return g, mg, values, default


def run(mg, backend):
    """Outputs, the host array address of every tensor, and the RSS growth while the backend
    was open (from just before it was made)."""
    from vmstoolkit.exec.executor import execute

    before = rss()
    try:
        execute(mg, backend)
        grown = rss() - before
        addrs = {t: a.__array_interface__["data"][0] for t, a in backend._host.items()}
        return backend.result(), addrs, grown
    finally:
        backend.close()


def fresh(values):
    return {k: v.copy() for k, v in values.items()}


def value_bytes(values) -> int:
    return sum(v.nbytes for v in values.values())


def test_the_default_copy_doubles_host_memory_while_a_backend_is_open(case):
    from vmstoolkit.exec.backends.cuda import CudaBackend

    g, mg, values, default = case
    out, _, grown = run(mg, CudaBackend(values))
    assert grown >= 0.8 * value_bytes(values), grown
    for t in default:
        np.testing.assert_array_equal(out[t], default[t])


@pytest.mark.parametrize("pin", ["in_place", "register"])
def test_two_backends_on_one_pool_share_slots_pin_nothing_new_and_equal_the_default(case, pin):
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.ops import reference_forward

    g, mg, values, default = case
    vals = fresh(values)
    with PinnedPool() as pool:
        out1, addrs1, _ = run(mg, CudaBackend(vals, pin=pin, pool=pool))
        stats = (pool.stats.alloc_calls, pool.stats.register_calls, pool.stats.allocated_bytes)
        out2, addrs2, grown = run(mg, CudaBackend(vals, pin=pin, pool=pool))
        assert (pool.stats.alloc_calls, pool.stats.register_calls, pool.stats.allocated_bytes) == stats
        # a host array is the caller's own (pinned in place or registered) or a lent slot (an
        # offload slot, or in "register" mode a copy of an input): the caller's arrays stay
        # tensor by tensor, the slots are the same set (which slot a tensor gets may differ)
        own = {t for t, a in vals.items() if addrs1.get(t) == a.ctypes.data}
        assert {t: addrs2[t] for t in own} == {t: addrs1[t] for t in own}
        assert sorted(x for t, x in addrs2.items() if t not in own) == \
            sorted(x for t, x in addrs1.items() if t not in own)
        assert own, "no caller array was used in place"
        assert grown < 0.1 * value_bytes(values), grown  # the second backend pins nothing
        pool._check()
    ref = reference_forward(g, values)
    for t in default:
        np.testing.assert_array_equal(out1[t], default[t])
        np.testing.assert_array_equal(out2[t], default[t])
        np.testing.assert_allclose(out1[t], ref[t], rtol=1e-5, atol=1e-5)
    assert all(np.array_equal(vals[k], values[k]) for k in values)  # the runtime wrote no value


def test_register_and_in_place_hold_one_set_of_values(case):
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.graph import TensorKind

    g, mg, values, default = case
    weights = sum(values[t.id].nbytes for t in g.tensors if t.kind is TensorKind.WEIGHT)
    vals = fresh(values)
    with PinnedPool() as pool:
        _, _, grown = run(mg, CudaBackend(vals, pin="register", pool=pool))
        assert pool.stats.registered_bytes == weights
        assert grown - pool.stats.allocated_bytes < 0.1 * weights, (grown, pool.stats)  # slots, no copies
    vals = fresh(values)
    before = rss()
    with PinnedPool() as pool:
        pool.pin(vals)  # replaces: the pageable originals are freed
        assert rss() - before < 0.2 * value_bytes(values), rss() - before
        _, _, grown = run(mg, CudaBackend(vals, pin="in_place", pool=pool))
        assert pool.stats.in_place_bytes == value_bytes(values) and grown - pool.stats.allocated_bytes < 0.1 * weights


def test_the_driver_sees_registrations_and_views_of_them():
    from vmstoolkit.exec.backends.host_memory import CudaHostMemory, PinnedPool

    mem = CudaHostMemory()
    a = np.ones(1 << 24, np.float32)
    assert not mem.is_pinned(a)
    with PinnedPool(mem) as pool:
        assert pool.register(a) is None and pool.register(a) is None  # the second call does nothing
        assert mem.is_pinned(a) and mem.is_pinned(a[1000:2000])
        assert pool.stats.register_calls == 1
    assert not mem.is_pinned(a)
    assert mem.is_pinned(mem.alloc(4096))


def test_the_products_sweeps_run_on_a_shared_pool():
    from vmstoolkit.exec.experiment import run_offload_experiment
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_experiment import run_train_experiment

    rows = run_offload_experiment("cuda", config=TINY, fractions=(1.0, 0.5), repeats=2)
    assert rows and all("makespan_s" in r for r in rows), rows
    cfg = LlamaConfig(n_blocks=2, seq=64, hidden=64, heads=4, kv_heads=2, ffn=128)
    rows = run_train_experiment("cuda", "full", ("0.5",), config=cfg, seq_range=(16, 64), steps=4, rank=4,
                                executors=("event-driven",))
    assert rows[0]["max_abs_grad_err"] is not None and rows[0]["max_abs_grad_err"] < 1e-3, rows
