"""Compaction instead of eviction (``compiler.py``'s Note [Compaction instead of eviction]): the
``move`` vertices are race free, the sim backend and the real backend (on Numba's CUDA
simulator) run them to the reference's values, and ``live_peak`` is the unconstrained peak."""

from __future__ import annotations

import numpy as np
import pytest

from tests.exec.helpers import random_graph, tiny_llama, weighted_chain
from tests.exec.model.helpers import folder
from tests.exec.test_budget_monotone import GRAPHS, unconstrained_peak
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import align, compile_memory_graph, live_peak, tensor_uses
from vmstoolkit.exec.errors import InvalidOptionError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import random_weights
from vmstoolkit.exec.ops import reference_forward


@pytest.mark.parametrize("name", GRAPHS)
def test_live_peak_is_the_unconstrained_compiles_peak(name):
    g = GRAPHS[name]()
    nbytes = [align(t.nbytes) for t in g.tensors]
    total = sum(nbytes)
    assert live_peak(g, nbytes, tensor_uses(g), g.n_gpus) == \
        compile_memory_graph(g, total, check_budget=False).peak_bytes


def _moves(mg):
    return [v for v in mg.vertices if v.kind == "move"]


def test_at_the_live_peak_the_generation_graph_compacts_and_moves_nothing_to_the_host():
    g = GRAPHS["llama-tied-gen8/64"]()
    peak = unconstrained_peak(g)
    mg = compile_memory_graph(g, peak)
    assert mg.offloaded_bytes == mg.reloaded_bytes == 0
    assert _moves(mg) and mg.compacted_bytes == sum(v.nbytes for v in _moves(mg))
    assert all(v.stream == "compute" and len(v.reads) == len(v.writes) == 1 for v in _moves(mg))
    check_race_free(mg)
    old = compile_memory_graph(g, peak, compact=False)  # what it did before: tokens offloaded
    assert not _moves(old) and old.offloaded_bytes > 0


def _numeric_cases():
    yield "random0", random_graph(0), 0.5
    yield "random2", random_graph(2), 0.5
    yield "random7-long", random_graph(7, n=60), 0.4
    yield "tiny-parts2", tiny_llama(parts=2), 0.6


@pytest.mark.parametrize("name,g,frac", list(_numeric_cases()), ids=lambda c: c if isinstance(c, str) else "")
@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_moves_are_race_free_and_give_the_reference_values(name, g, frac, executor):
    values = random_weights(g, seed=1)
    ref = reference_forward(g, values)
    mg = compile_memory_graph(g, int(unconstrained_peak(g) * frac), compact=True)
    check_race_free(mg)
    for seed in range(6):  # jitter 3: many completion orders
        be = SimBackend(seed=seed, jitter=3.0, numerics=True, values=values)
        execute(mg, be, executor)
        out = be.result()
        for t in g.outputs:
            np.testing.assert_allclose(out[t], ref[t], rtol=1e-5, atol=1e-5)


def test_compaction_anywhere_moves_tensors_on_the_numeric_cases():
    assert any(_moves(compile_memory_graph(g, int(unconstrained_peak(g) * f), compact=True))
               for _, g, f in _numeric_cases())


def test_a_move_whose_wait_is_dropped_shows_up_as_a_wrong_result():
    """What makes the equality above meaningful: drop the edges into a move, and some completion
    order reads bytes not written yet or overwritten."""
    g = random_graph(7, n=60)
    values = random_weights(g, seed=1)
    ref = reference_forward(g, values)
    mg = compile_memory_graph(g, int(unconstrained_peak(g) * 0.4), compact=True)
    wrong = 0
    for mv in _moves(mg):
        saved = mg.preds[mv.id]
        mg.preds[mv.id] = []
        for seed in range(4):
            be = SimBackend(seed=seed, jitter=3.0, numerics=True, values=values)
            execute(mg, be, "event-driven")
            out = be.result()
            wrong += not all(np.allclose(out[t], ref[t], rtol=1e-5, atol=1e-5) for t in g.outputs)
        mg.preds[mv.id] = saved
    assert wrong > 0


def test_the_cuda_backend_runs_moves(sim_gpu):
    from tests.exec.helpers import FakeHostMemory
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.backends.host_memory import PinnedPool

    g = random_graph(0)
    values = random_weights(g, 0)
    ref = reference_forward(g, values)
    mg = compile_memory_graph(g, int(unconstrained_peak(g) * 0.5), compact=True)
    assert _moves(mg) and mg.reloaded_bytes > 0  # moves and host copies both run
    with PinnedPool(FakeHostMemory(), register_min_bytes=0) as pool:
        be = CudaBackend({k: v.copy() for k, v in values.items()}, pool=pool)
        try:
            execute(mg, be)
            out = be.result()
        finally:
            be.close()
    for t in g.outputs:
        np.testing.assert_allclose(out[t], ref[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["yes", 1.5, "none"])
def test_a_bad_compact_option_is_one_line(bad):
    with pytest.raises(InvalidOptionError, match=r"^compact=.*must be True, False or None") as e:
        compile_memory_graph(weighted_chain(), 10 ** 6, compact=bad)
    assert "\n" not in str(e.value)


def test_generation_rows_are_unchanged_in_shape_with_moves():
    from vmstoolkit.exec.model.generate import run_generate

    (r,) = run_generate(folder("llama-tied"), prompt_len=8, new_tokens=64, budgets=("1.0",))
    assert r["offloaded_bytes"] == r["reloaded_bytes"] == 0 and r["tokens"] is not None
