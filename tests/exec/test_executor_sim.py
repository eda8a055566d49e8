import numpy as np
import pytest

from tests.exec.helpers import random_graph, tiny_llama
from vmstoolkit.exec.backends.sim import CostModel, SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, build_llama, random_weights
from vmstoolkit.exec.ops import reference_forward


def cases():
    yield "llama", tiny_llama(parts=1), (1.0, 0.4)
    yield "llama-parts", tiny_llama(parts=2), (0.5, 0.25)
    yield "llama-2gpu", tiny_llama(parts=2, n_gpus=2, n_blocks=4), (1.0, 0.3)
    yield "random", random_graph(3, n=40), (0.5, 0.25)


@pytest.mark.parametrize("name,g,fracs", list(cases()))
@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_same_result_under_random_completion_orders(name, g, fracs, executor):
    values = random_weights(g, seed=1)
    ref = reference_forward(g, values)
    orders = set()
    for frac in fracs:
        budget = max(int(working_set(g) * frac), 2 * max(map(g.vertex_bytes, g.vertices)))
        mg = compile_memory_graph(g, budget)
        for seed in range(8):
            # jitter 3: durations vary 4x, so completions come in many different orders
            be = SimBackend(seed=seed, jitter=3.0, numerics=True, values=values)
            r = execute(mg, be, executor)
            orders.add(tuple(r.finish_order))
            out = be.result()
            for t in g.outputs:
                assert np.isfinite(ref[t]).all()
                np.testing.assert_allclose(out[t], ref[t], rtol=1e-5, atol=1e-5)
    assert len(orders) > len(fracs), "the jitter should produce several completion orders"


def test_a_race_shows_up_as_a_wrong_result():
    """Remove a reuse edge: in some completion order the sim must compute a wrong output,
    which is what makes the equality test above meaningful."""
    g = tiny_llama(parts=2)
    values = random_weights(g, seed=1)
    ref = reference_forward(g, values)[g.outputs[0]]
    mg = compile_memory_graph(g, int(working_set(g) * 0.3))
    reuse = [e for e, k in mg.kinds.items() if k == "reuse"]
    wrong = 0
    for u, v in reuse[:20]:
        saved = mg.preds[v]
        mg.preds[v] = [p for p in saved if p != u]
        for seed in range(4):
            be = SimBackend(seed=seed, jitter=3.0, numerics=True, values=values)
            execute(mg, be, "event-driven")
            wrong += not np.allclose(be.result()[g.outputs[0]], ref, rtol=1e-5, atol=1e-5)
        mg.preds[v] = saved
    assert wrong > 0


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_makespan_not_below_lower_bound(executor):
    g = tiny_llama(parts=2)
    cost = CostModel()
    for frac in (1.0, 0.5, 0.25):
        mg = compile_memory_graph(g, int(working_set(g) * frac))
        r = execute(mg, SimBackend(cost, seed=0, jitter=0.5), executor)
        assert r.makespan_s >= cost.lower_bound(mg)["lower_bound_s"]


def test_llama7b_half_budget_near_lower_bound_and_beats_fixed_order():
    """16 LLaMA-7B-wide blocks, 1 x 2048 prefill, fp32, H200-like costs: at half the no-offload
    working set the event-driven executor stays within 1.25x of max(compute, copies)."""
    g = build_llama(LlamaConfig(n_blocks=16), parts=1)
    cost = CostModel()
    mg = compile_memory_graph(g, working_set(g) // 2)
    lb = cost.lower_bound(mg)["lower_bound_s"]
    ev = [execute(mg, SimBackend(cost, seed=s, jitter=0.05), "event-driven").makespan_s for s in range(3)]
    fx = [execute(mg, SimBackend(cost, seed=s, jitter=0.05), "fixed-order").makespan_s for s in range(3)]
    assert max(ev) <= 1.25 * lb
    assert np.mean(ev) <= np.mean(fx)


def test_two_gpus_drive_from_one_loop():
    g = tiny_llama(parts=1, n_gpus=2, n_blocks=4)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    be = SimBackend(seed=0)
    execute(mg, be, "event-driven")
    used = {k for k, busy in be.busy.items() if busy > 0}
    assert {(0, "compute"), (1, "compute")} <= used
