"""The CUDA backend's host memory (``vmstoolkit/exec/backends/host_memory.py``, issue 17's host
half): a pool shared by successive backends pins nothing new, ``pin="in_place"`` and
``pin="register"`` keep one set of values, and every mode gives the same results.

The real backend runs here on the CPU: Numba's CUDA simulator executes its kernels and copies,
the GPU region is a numpy byte array (``take_region`` and ``device_view`` replaced), CUDA events
complete at once, and pinned memory is :class:`FakeHostMemory`, which counts every allocation
and registration (``cuMemHostRegister`` cannot run without a GPU; the real calls are checked by
``tests/gpu/test_host_memory_gpu.py``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import vmstoolkit.exec.backends.cuda as cuda_backend
from tests.exec.helpers import FakeHostMemory, weighted_chain
from vmstoolkit.errors import InvalidFreeError
from vmstoolkit.exec.backends import host_memory
from vmstoolkit.exec.backends.cuda import CudaBackend
from vmstoolkit.exec.backends.host_memory import PinFallbackWarning, PinnedPool
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import CudaCallError, ExecutionError, InvalidGraphError, InvalidOptionError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import TensorKind, random_weights
from vmstoolkit.exec.ops import reference_forward


@pytest.fixture(scope="module")
def case():
    g = weighted_chain()
    values = random_weights(g, 0)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0  # slots and reloads are exercised
    ref = reference_forward(g, values)
    return g, mg, values, {t: ref[t] for t in g.outputs}


def run(mg, backend):
    try:
        execute(mg, backend)
        return backend.result()
    finally:
        backend.close()


def assert_equal_outputs(got, want):
    assert set(got) == set(want)
    for t in want:
        np.testing.assert_allclose(got[t], want[t], rtol=1e-5, atol=1e-6)


def fresh(values):
    return {k: v.copy() for k, v in values.items()}


@pytest.mark.parametrize("pin", ["copy", "in_place", "register"])
def test_a_second_backend_on_the_same_pool_pins_nothing_new(sim_gpu, case, pin):
    g, mg, values, want = case
    values = fresh(values)
    mem = FakeHostMemory()
    pool = PinnedPool(mem, register_min_bytes=0)
    assert_equal_outputs(run(mg, CudaBackend(values, pin=pin, pool=pool)), want)
    first = (len(mem.allocated), dict(mem.registered))
    assert first[0] > 0  # slots at least
    pool._check()
    assert_equal_outputs(run(mg, CudaBackend(values, pin=pin, pool=pool)), want)
    assert (len(mem.allocated), mem.registered) == first  # the same slots, the same registrations
    assert pool.stats.lent_bytes == 0
    pool._check()
    pool.close()
    assert mem.registered == {} and pool.stats.allocated_bytes == 0


def test_register_copies_no_value_and_leaves_the_callers_dict_alone(sim_gpu, case):
    g, mg, values, want = case
    values = fresh(values)
    before = dict(values)
    saved = fresh(values)
    mem = FakeHostMemory()
    with PinnedPool(mem, register_min_bytes=0) as pool:
        assert_equal_outputs(run(mg, CudaBackend(values, pin="register", pool=pool)), want)
        kind = {t.id: t.kind for t in g.tensors}
        weights = [k for k in values if kind[k] is TensorKind.WEIGHT]
        assert pool.stats.registered_bytes == sum(values[k].nbytes for k in weights) == sum(mem.registered.values())
        # no weight was copied: the input (new every step in a loop) sits in a slot, with the offloads
        assert pool.stats.copied_bytes == values[g.tensors[0].id].nbytes
        offloads = {v.tensor for v in mg.vertices if v.kind == "offload"}
        assert pool.stats.allocated_bytes == g.tensors[0].nbytes + sum(g.tensors[t].nbytes for t in offloads)
    assert all(values[k] is before[k] for k in values)  # same arrays...
    assert all(np.array_equal(values[k], saved[k]) for k in values)  # ...never written by the runtime
    assert mem.registered == {} and len(mem.unregistered) == len(weights)


def test_in_place_replaces_the_callers_arrays_once(sim_gpu, case):
    g, mg, values, want = case
    values = fresh(values)
    saved = fresh(values)
    mem = FakeHostMemory()
    with PinnedPool(mem) as pool:
        run(mg, CudaBackend(values, pin="in_place", pool=pool))
        assert all(mem.is_pinned(v) for v in values.values())  # the dict now holds pinned copies
        assert all(np.array_equal(values[k], saved[k]) for k in values)
        pinned = dict(values)
        n = len(mem.allocated)
        # without the pool too: a later backend finds the values pinned and copies nothing
        out = run(mg, CudaBackend(values, pin="in_place", pool=PinnedPool(mem)))
        assert all(values[k] is pinned[k] for k in values)
        assert len(mem.allocated) == n + len({v.tensor for v in mg.vertices if v.kind == "offload"})  # its slots
    assert_equal_outputs(out, want)


def test_in_place_copies_once_even_if_the_driver_cannot_tell_pinned_memory(sim_gpu, case, monkeypatch):
    # the pool knows the copies it made: a driver query that answers "pageable" for them (or
    # fails) must not make every later backend pin the values again (two sets of host memory)
    g, mg, values, want = case
    values = fresh(values)
    mem = FakeHostMemory()
    monkeypatch.setattr(mem, "is_pinned", lambda array: False)
    with PinnedPool(mem) as pool:
        pool.pin(values)
        pinned = dict(values)
        n = pool.stats.in_place_bytes
        for _ in range(2):
            out = run(mg, CudaBackend(values, pin="in_place", pool=pool))
            assert all(values[k] is pinned[k] for k in values) and pool.stats.in_place_bytes == n
    assert_equal_outputs(out, want)


def test_pool_pin_before_any_backend_serves_a_reference_run_too(sim_gpu, case):
    g, mg, values, want = case
    values = fresh(values)
    mem = FakeHostMemory()
    with PinnedPool(mem) as pool:
        pool.pin(values)  # in place
        pool.pin(values)  # idempotent
        assert pool.stats.alloc_calls == len(values)
        assert_equal_outputs(run(mg, CudaBackend(values, pin="in_place", pool=pool)), want)
        slots = len({v.tensor for v in mg.vertices if v.kind == "offload"})
        assert pool.stats.alloc_calls == len(values) + slots


def test_the_default_copy_path_still_copies_and_frees_its_pins_on_close(sim_gpu, case, monkeypatch):
    """No pool: each backend pins its own copies and slots (the behaviour kept) and gives them
    back when it closes, not whenever numba's deferred frees next run."""
    g, mg, values, want = case
    mem = FakeHostMemory()
    monkeypatch.setattr(host_memory, "CudaHostMemory", lambda: mem)
    values = fresh(values)
    be = CudaBackend(values)
    execute(mg, be)
    assert_equal_outputs(be.result(), want)
    pool = be.pool
    assert pool.stats.copied_bytes == sum(v.nbytes for v in values.values())
    be.close()
    assert pool.closed and pool.stats.allocated_bytes == 0 and mem.flushes == 1
    be.close()  # twice is fine


def test_the_legacy_host_dict_is_still_filled_and_reused(sim_gpu, case, monkeypatch):
    g, mg, values, want = case
    mem = FakeHostMemory()
    monkeypatch.setattr(host_memory, "CudaHostMemory", lambda: mem)
    host: dict = {}
    assert_equal_outputs(run(mg, CudaBackend(values, host=host)), want)
    n = len(mem.allocated)
    assert set(host) >= set(values) and n == len(host)
    assert_equal_outputs(run(mg, CudaBackend(values, host=host)), want)
    assert len(mem.allocated) == n


def test_register_falls_back_to_a_copy_with_one_warning_naming_each_array(sim_gpu, case):
    g, mg, values, want = case
    values = fresh(values)
    names = {t.id: t.name for t in g.tensors}
    ids = sorted(values)
    values[ids[1]] = np.asfortranarray(values[ids[1]])  # not C-contiguous
    values[ids[2]].flags.writeable = False  # read-only
    values[ids[3]] = values[ids[3]].astype(np.float64)  # another dtype
    mem = FakeHostMemory()
    mem.refuse[values[ids[4]].__array_interface__["data"][0]] = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
    with PinnedPool(mem, register_min_bytes=0) as pool:
        with pytest.warns(PinFallbackWarning) as rec:
            out = run(mg, CudaBackend(values, pin="register", pool=pool))
        assert len(rec) == 1
        msg = str(rec[0].message)
        assert "\n" not in msg and "copied 4 array(s)" in msg
        for i, why in ((1, "not C-contiguous"), (2, "read-only"), (3, "float64"),
                       (4, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")):
            assert f"{names[ids[i]]} (" in msg and why in msg
        assert pool.stats.registered_bytes == sum(values[k].nbytes for k in ids[5:])  # ids[0] is the input
    assert_equal_outputs(out, want)


def test_register_copies_small_arrays_without_a_warning(sim_gpu, case):
    g, mg, values, want = case
    mem = FakeHostMemory()
    with PinnedPool(mem) as pool:  # every value of this graph is below REGISTER_MIN_BYTES
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = run(mg, CudaBackend(fresh(values), pin="register", pool=pool))
        assert mem.registered == {} and pool.stats.copied_bytes == sum(v.nbytes for v in values.values())
    assert_equal_outputs(out, want)


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(InvalidOptionError, match="'pinned'"):
        CudaBackend({}, pin="pinned")
    with pytest.raises(InvalidOptionError, match="host="):
        CudaBackend({}, host={}, pool=PinnedPool(FakeHostMemory()))
    with pytest.raises(InvalidOptionError, match="host="):
        CudaBackend({}, host={}, pin="register")
    pool = PinnedPool(FakeHostMemory())
    pool.close()
    with pytest.raises(InvalidOptionError, match="closed"):
        CudaBackend({}, pool=pool)
    with pytest.raises(InvalidOptionError, match="'in_place' or 'register'"):
        PinnedPool(FakeHostMemory()).pin({}, "copy")


def test_a_missing_value_is_named(case):
    g, mg, values, _ = case
    values = dict(values)
    del values[g.tensors[0].id]
    with pytest.raises(InvalidOptionError, match="'x'"):
        PinnedPool(FakeHostMemory()).place(g, [], values, "copy", [])


def test_an_offload_of_a_weight_is_refused(case):
    """The runtime writes only slots of activations: never a caller's (pinned or registered) array."""
    g, mg, values, _ = case
    w = next(t.id for t in g.tensors if t.kind is TensorKind.WEIGHT)
    with pytest.raises(InvalidGraphError, match="'w0'"):
        PinnedPool(FakeHostMemory()).place(g, [w], values, "register", [])


def test_slots_are_lent_once_and_given_back_once():
    pool = PinnedPool(FakeHostMemory())
    a = pool.lend((4, 4), np.float32)
    b = pool.lend((16,), np.float32)
    assert a.shape == (4, 4) and a.dtype == np.float32 and pool.stats.alloc_calls == 2
    with pytest.raises(ExecutionError, match="still lent"):
        pool.close()
    pool.give_back([a])
    with pytest.raises(InvalidFreeError):
        pool.give_back([a])
    c = pool.lend((2, 8), np.float32)  # 64 bytes: a's slot again
    assert pool.stats.alloc_calls == 2 and c.shape == (2, 8)
    pool._check()
    pool.give_back([b, c])
    assert pool.trim() == 128 and pool.stats.allocated_bytes == 0
    pool._check()
    pool.close()
    pool.close()


def test_the_runtime_never_writes_a_weight_or_input_of_a_training_step():
    """What makes ``in_place`` and ``register`` safe across repeats: AdamW writes new tensors
    (``{param}.new``), and the compiler offloads only activations, even at a small budget."""
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_graph import build_train_step

    for variant in ("lora", "full"):
        tg = build_train_step(LlamaConfig(n_blocks=2, seq=8, hidden=32, heads=4, kv_heads=2, ffn=48), variant, rank=4)
        g = tg.graph
        assert all(g.tensors[o].kind is TensorKind.ACTIVATION for v in g.vertices for o in v.outputs)
        mg = compile_memory_graph(g, int(working_set(g) * 0.25))
        offloaded = [v.tensor for v in mg.vertices if v.kind == "offload"]
        assert offloaded and all(g.tensors[t].kind is TensorKind.ACTIVATION for t in offloaded)


class SpyBackends:
    """``CudaBackend`` replaced by the simulated backend, recording the host-memory options of
    every backend the product's sweeps make."""

    def __init__(self, monkeypatch):
        from vmstoolkit.exec.backends.sim import CostModel, SimBackend

        self.made = []
        cost = CostModel()

        def make(values, **kw):
            self.made.append(kw)
            return SimBackend(cost, numerics=True, values=values)

        monkeypatch.setattr(cuda_backend, "CudaBackend", make)
        monkeypatch.setattr(cuda_backend, "measure_lower_bound", lambda mg, values: cost.lower_bound(mg))

    def one_pool_closed(self, pin):
        pools = {id(kw["pool"]) for kw in self.made}
        assert len(self.made) > 1 and len(pools) == 1 and all(kw["pin"] == pin for kw in self.made)
        assert self.made[0]["pool"].closed


def test_the_offload_experiment_shares_one_pool_over_its_runs(monkeypatch):
    import vmstoolkit.exec.experiment as experiment
    from tests.exec.helpers import TINY

    spy = SpyBackends(monkeypatch)
    monkeypatch.setattr(experiment, "require_gpus", lambda n: None)
    rows = experiment.run_offload_experiment("cuda", config=TINY, fractions=(1.0, 0.5), repeats=2)
    assert all("makespan_s" in r for r in rows)
    spy.one_pool_closed("in_place")  # its values are its own: pinned in place once


def test_the_training_loop_shares_one_pool_over_its_steps(monkeypatch):
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_experiment import run_train_experiment

    spy = SpyBackends(monkeypatch)
    cfg = LlamaConfig(n_blocks=1, seq=8, hidden=32, heads=4, kv_heads=2, ffn=48)
    rows = run_train_experiment("cuda", "lora", ("0.5",), config=cfg, seq_range=(4, 16), steps=3, rank=4,
                                check_grads=False, executors=("event-driven",))
    assert len(rows) == 1
    spy.one_pool_closed("register")  # a step's values are a new dict: registered, not replaced


@pytest.fixture
def break_binding(monkeypatch):
    """``break_binding(name, message)``: ``cuda.bindings.driver.<name>`` raises TypeError(message),
    as a binding does for arguments it refuses (the driver is never reached)."""
    from cuda.bindings import driver as cu
    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("runs on Numba's CUDA simulator")

    def brk(name, message):
        def broken(*args):
            raise TypeError(message)

        monkeypatch.setattr(cu, name, broken)
    return brk


def test_a_pinned_query_the_binding_cannot_answer_means_pageable_with_one_warning(break_binding):
    # the driver's answer is only an optimisation: a binding that fails in an unexpected way makes
    # the pool copy (safe), says so once, and does not end the run
    break_binding("cuPointerGetAttribute", "Argument 'ptr' is not instance of type (expected <class 'int'>)")
    mem = host_memory.CudaHostMemory()
    with pytest.warns(PinFallbackWarning, match="cannot ask the driver whether host memory is pinned") as caught:
        assert mem.is_pinned(np.zeros(4, np.float32)) is False
        assert mem.is_pinned(np.zeros(8, np.float32)) is False
    assert len(caught) == 1


def test_a_registration_the_binding_rejects_falls_back_to_a_copy(break_binding):
    # a binding-level failure of cuMemHostRegister (not a CUresult) is the pool's usual
    # "could not register" (a reason returned, so the backend copies into a pinned slot)
    break_binding("cuMemHostRegister", "an integer is required")
    with pytest.raises(CudaCallError, match="TypeError: cuMemHostRegister of 16 bytes .*an integer is required"):
        host_memory.CudaHostMemory().register(np.zeros(4, np.float32))
    pool = PinnedPool(FakeHostMemory())
    pool._memory.register = host_memory.CudaHostMemory().register  # the real call, failing in the binding
    assert "TypeError" in pool.register(np.zeros(4, np.float32))
