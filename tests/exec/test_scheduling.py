"""Scheduling at a shape nobody tuned (issue 32, item 7) and GPUs sharing one host link (item 9),
on the sim backend with the H200's host costs (``CostModel.h200``)."""

import asyncio

import numpy as np
import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec.backends.sim import CostModel, SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import InvalidOptionError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, build_llama
from vmstoolkit.exec.train_graph import build_train_step

# the shape of issue 32 that ran at 1.27x its bound on the H200
WIDE = LlamaConfig(n_blocks=12, seq=1536, hidden=5120, heads=40, kv_heads=8, ffn=13824)


@pytest.fixture(scope="module")
def wide_graph():
    g = build_train_step(WIDE, "lora").graph
    return g, working_set(g)


@pytest.fixture(scope="module")
def wide_quarter(wide_graph):
    g, ws = wide_graph
    return compile_memory_graph(g, int(ws * 0.25))


def _ratio(mg, cost, executor, bound="resource_s", **kw):
    lb = cost.lower_bound(mg)[bound]
    return np.mean([execute(mg, SimBackend(cost, seed=s, jitter=0.05), executor, **kw).makespan_s
                    for s in range(2)]) / lb


def test_wide_lora_with_h200_host_costs_comes_within_1_2x_of_its_bound_ahead_of_fixed_order(wide_graph, wide_quarter):
    """Against max(compute, copies). Before arming compute on launched copies, the copy window,
    compute in compile order and the compiler's prefetch: 1.23x (fixed-order 1.38x), as the
    executor and the compiler still run without them."""
    cost = CostModel.h200()
    ev = _ratio(wide_quarter, cost, "event-driven")
    assert ev <= 1.20
    assert ev <= _ratio(wide_quarter, cost, "fixed-order")
    g, ws = wide_graph
    old = compile_memory_graph(g, int(ws * 0.25), prefetch=False)
    assert _ratio(old, cost, "event-driven", device_waits=False, copy_window=0, compute_in_order=False) > 1.20


def test_armed_launches_keep_every_edge_on_the_device_and_the_result():
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.25))
    from vmstoolkit.exec.graph import random_weights
    from vmstoolkit.exec.ops import reference_forward

    values = random_weights(g, 0)
    ref = reference_forward(g, values)[g.outputs[0]]
    ran = 0
    for seed in range(4):
        be = SimBackend(CostModel.h200(), seed=seed, jitter=0.9, numerics=True, values=values)
        r = execute(mg, be, "event-driven")
        np.testing.assert_allclose(be.result()[g.outputs[0]], ref, rtol=1e-5, atol=1e-5)
        starts = {v: a for v, _, _, a, _ in be.spans}
        ends = {v: b for v, _, _, _, b in be.spans}
        # every edge holds on the device: a vertex starts after each predecessor ends (or is
        # queued behind it on its own stream)
        for v, ps in enumerate(mg.preds):
            for u in ps:
                assert starts[v] >= ends[u] - 1e-12
        ran += len(r.finish_order)
    assert ran == 4 * len(mg.vertices)


def test_device_waits_need_a_backend_that_has_them():
    class NoWaits(SimBackend):
        device_waits = False

    g = tiny_llama(parts=1)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    with pytest.raises(InvalidOptionError, match="cannot make a stream wait"):
        execute(mg, NoWaits(), "event-driven", device_waits=True)
    assert execute(mg, NoWaits(), "event-driven").n_vertices == len(mg.vertices)  # host waits then


# -- one host link for several GPUs ------------------------------------------------------------


def _copy_spans(be, kind):
    return sorted((a, b) for v, g, s, a, b in be.spans if be.mg.vertices[v].kind == kind)


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_a_shared_link_moves_one_copy_at_a_time_and_never_faster_than_its_rate(executor):
    g = build_llama(LlamaConfig(n_blocks=4, seq=256), parts=2, n_gpus=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.3))
    assert all(mg.bytes_moved("reload", gpu) > 0 for gpu in range(2))
    link = 30e9
    cost = CostModel(host_link_bytes_per_s=link)
    be = SimBackend(cost, seed=1, jitter=0.3)
    r = execute(mg, be, executor)
    spans = _copy_spans(be, "reload")
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        assert a1 >= b0 - 1e-12  # the two GPUs' reloads never overlap on the link
    busy = sum(b - a for a, b in spans)
    assert busy >= mg.bytes_moved("reload") / link
    assert r.makespan_s >= mg.bytes_moved("reload") / link
    assert cost.lower_bound(mg)["h2d_s"] == pytest.approx(mg.bytes_moved("reload") / link)


def test_two_gpus_on_one_link_are_no_faster_than_on_their_own_links():
    g = build_llama(LlamaConfig(n_blocks=4, seq=256), parts=2, n_gpus=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.3))
    own = execute(mg, SimBackend(CostModel(), seed=0, jitter=0.0), "event-driven").makespan_s
    shared = execute(mg, SimBackend(CostModel(host_link_bytes_per_s=55e9), seed=0, jitter=0.0),
                     "event-driven").makespan_s
    assert shared >= own


def test_one_gpu_on_a_link_as_fast_as_its_own_runs_as_before():
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.25))
    spans = [execute(mg, SimBackend(CostModel(host_link_bytes_per_s=link), seed=3), "event-driven").makespan_s
             for link in (None, 55e9, 1e12)]
    assert spans[0] == spans[1] == spans[2]


def test_the_bound_of_gpus_that_share_nothing_is_the_busiest_gpu_not_their_sum():
    from vmstoolkit.exec.graph import TaskGraph

    g1 = build_llama(LlamaConfig(n_blocks=2, seq=512))
    g = TaskGraph()
    for i in range(2):  # two replicas, one per GPU, no tensor in common
        tid = {t.id: g.tensor(f"r{i}.{t.name}", t.shape, t.dtype, i, t.kind) for t in g1.tensors}
        for v in g1.vertices:
            g.add(f"r{i}.{v.name}", v.op, [tid[t] for t in v.inputs], [tid[t] for t in v.outputs], gpu=i,
                  params=v.params, views=v.views, flops=v.flops)
    mg = compile_memory_graph(g, working_set(g))
    cost = CostModel()
    one = cost.lower_bound(compile_memory_graph(g1, working_set(g1)))["compute_s"]
    assert cost.lower_bound(mg)["compute_s"] == pytest.approx(one)
    r = execute(mg, SimBackend(cost, seed=0, jitter=0.0), "event-driven")
    assert r.makespan_s < 2 * one  # the replicas ran side by side: a sum would not have been a bound
    pipe = compile_memory_graph(tiny_llama(parts=1, n_gpus=2, n_blocks=4), 1 << 30)
    comp = [sum(cost.duration(pipe, v) for v in pipe.vertices if v.stream == "compute" and v.gpu == k) for k in (0, 1)]
    assert cost.lower_bound(pipe)["compute_s"] == pytest.approx(sum(comp))


# -- the precedence bound -----------------------------------------------------------------------


class _Graph:
    """A memory graph's shape alone: vertices (gpu, stream) and predecessors."""

    def __init__(self, streams, preds):
        from types import SimpleNamespace

        self.vertices = [SimpleNamespace(gpu=0, stream=s) for s in streams]
        self.preds = preds

    def succs(self):
        out = [[] for _ in self.preds]
        for v, ps in enumerate(self.preds):
            for u in ps:
                out[u].append(v)
        return out


def test_the_precedence_bound_adds_what_must_come_before_and_after_on_other_streams():
    from vmstoolkit.exec.bounds import precedence_bound, resource_bound

    # reload (1 s) -> kernel (1 s) -> offload (1 s), and a second kernel (2 s) in parallel:
    # every stream's work is at most 3 s, but the chain takes 3 s and kernel 1 waits for the copy
    g = _Graph(["h2d", "compute", "d2h", "compute"], [[], [0], [1], []])
    d = [1.0, 1.0, 1.0, 2.0]
    assert resource_bound(g, d) == 3.0
    assert precedence_bound(g, d) == (3.0, 1)
    # two reloads before a kernel, one offload after it: 2 + 1 + 1 against the busiest stream's 2
    g = _Graph(["h2d", "h2d", "compute", "d2h"], [[], [], [0, 1], [2]])
    assert precedence_bound(g, [1.0, 1.0, 1.0, 1.0]) == (4.0, 2)
    assert resource_bound(g, [1.0, 1.0, 1.0, 1.0]) == 2.0


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_no_run_beats_the_precedence_bound(executor):
    for g in (tiny_llama(parts=2), build_train_step(LlamaConfig(n_blocks=2, seq=8, hidden=32, heads=4, kv_heads=2,
                                                                ffn=48), "full").graph):
        for frac in (0.5, 0.25):
            mg = compile_memory_graph(g, int(working_set(g) * frac))
            for cost in (CostModel(), CostModel.h200()):
                lb = cost.lower_bound(mg)
                assert lb["lower_bound_s"] >= lb["resource_s"]
                for seed in range(3):
                    r = execute(mg, SimBackend(cost, seed=seed, jitter=0.5), executor)
                    assert r.makespan_s >= lb["precedence_s"]


def test_the_precedence_bound_is_tighter_where_copies_and_compute_take_turns(wide_quarter):
    lb = CostModel().lower_bound(wide_quarter)
    assert lb["precedence_s"] >= 1.05 * lb["resource_s"]  # 1.077x (1.105x before the compiler's prefetch)
    assert lb["lower_bound_s"] == lb["precedence_s"]


def test_the_cuda_backend_runs_armed_launches_to_the_same_result(sim_gpu):
    """The real CudaBackend (Numba's CUDA simulator): compute launched behind copies still in
    flight, its stream waiting on their events, gives the reference outputs."""
    from tests.exec.helpers import FakeHostMemory, weighted_chain
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.graph import random_weights
    from vmstoolkit.exec.ops import reference_forward

    g = weighted_chain()
    values = random_weights(g, 0)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    ref = reference_forward(g, values)
    waited = []

    class Counting(CudaBackend):
        def launch(self, v, after=()):
            waited.extend((u, v.id) for u in after)
            return super().launch(v, after)

    pool = PinnedPool(FakeHostMemory(), register_min_bytes=0)
    be = Counting(values, pool=pool)
    try:
        execute(mg, be, "event-driven")
        got = be.result()
    finally:
        be.close()
        pool.close()
    for t in g.outputs:
        np.testing.assert_allclose(got[t], ref[t], rtol=1e-5, atol=1e-6)
    assert waited and all(mg.vertices[u].kind == "reload" or mg.vertices[u].stream != "compute" for u, _ in waited)
