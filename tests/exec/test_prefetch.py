"""The compiler's prefetch by need time and the executor's compute streams in compile order
(issue 32, item 7): tiny graphs, the sim backend without host costs or jitter."""

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec.backends.sim import CostModel, SimBackend
from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import (EST_COPY_BYTES_PER_S, EST_COPY_S, EST_FLOPS_PER_S, compile_memory_graph,
                                      working_set)
from vmstoolkit.exec.errors import InvalidOptionError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import TaskGraph, TensorKind

N, W = 6, 1 << 20  # weights of 1 MiB (256 x 1024 fp32)


def gemm_chain() -> TaskGraph:
    """x -> op0(x, w0) -> op1(., w1) ... : one weight a vertex, used once, each vertex's compute
    1.2x its weight's copy (by the compiler's estimates), activations of 4 KiB."""
    g = TaskGraph()
    x = g.tensor("x", (1, 1024), kind=TensorKind.INPUT)
    flops = 1.2 * (EST_COPY_S + W / EST_COPY_BYTES_PER_S) * EST_FLOPS_PER_S
    for i in range(N):
        w = g.tensor(f"w{i}", (256, 1024), kind=TensorKind.WEIGHT)
        y = g.tensor(f"y{i}", (1, 1024))
        g.add(f"op{i}", "linear", [x, w], [y], flops=flops)
        x = y
    g.outputs = [x]
    return g


# room for two weights and the activations, not three: a weight's reload must share the region
# with the weight in use
BUDGET = 2 * W + 16 * 4096
COST = CostModel(flops_per_s=EST_FLOPS_PER_S, h2d_bytes_per_s=EST_COPY_BYTES_PER_S, launch_s=0, notify_s=0)


def _position(mg, name):
    return next(v.id for v in mg.vertices if v.name == name)


def test_a_reload_is_issued_one_compute_ahead_of_its_use_and_overlaps_it():
    g = gemm_chain()
    new = compile_memory_graph(g, BUDGET)
    old = compile_memory_graph(g, BUDGET, prefetch=False)
    check_race_free(new)
    assert new.reloaded_bytes == old.reloaded_bytes  # the same copies, issued earlier
    for i in range(2, N):  # w0, w1 preloaded
        # before: the reload right before its use, after the previous op (whose weight's bytes it takes)
        assert _position(old, f"op{i - 1}") < _position(old, f"reload w{i}") < _position(old, f"op{i}")
        # now: before the previous op, so that the copy runs while that op computes
        assert _position(new, f"reload w{i}") < _position(new, f"op{i - 1}")
    spans = {k: execute(mg, SimBackend(COST, jitter=0), "event-driven").makespan_s for k, mg in
             (("old", old), ("new", new))}
    assert spans["new"] < 0.8 * spans["old"]  # copies beside compute, not between: 1.5x -> ~1.0x
    assert spans["new"] <= 1.1 * COST.lower_bound(new)["lower_bound_s"]


def test_a_prefetch_evicts_nothing_used_before_the_reload_it_makes_room_for():
    """With room for one weight and a half, the next weight fits only by evicting the one in
    use: no prefetch then, the graph is the one compiled without it."""
    g = gemm_chain()
    budget = W + W // 2 + 16 * 4096
    new, old = compile_memory_graph(g, budget), compile_memory_graph(g, budget, prefetch=False)
    assert [v.name for v in new.vertices] == [v.name for v in old.vertices]
    assert new.preds == old.preds


@pytest.mark.parametrize("frac", [0.5, 0.25])
def test_compute_streams_launch_in_compile_order(frac):
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, int(working_set(g) * frac))
    order = {}
    for in_order in (True, False):
        r = execute(mg, SimBackend(CostModel.h200(), seed=1, jitter=0.5), "event-driven", compute_in_order=in_order)
        order[in_order] = [v for v in r.launch_order if mg.vertices[v].stream == "compute"]
        assert sorted(r.finish_order) == list(range(len(mg.vertices)))
    assert order[True] == sorted(order[True])
    assert order[False] != sorted(order[False])  # else this graph shows nothing


class _CountingSim(SimBackend):
    """Counts the compute vertices in flight (launched, not yet completed) and keeps the most."""

    def setup(self, mg):
        super().setup(mg)
        self.now_in_flight = self.most_in_flight = 0

    def launch(self, v, after=()):
        fut = super().launch(v, after)
        if v.stream == "compute":
            self.now_in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.now_in_flight)
            fut.add_done_callback(lambda f: setattr(self, "now_in_flight", self.now_in_flight - 1))
        return fut


def test_a_compute_stream_holds_at_most_compute_depth_vertices_in_flight():
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.25))
    most = {}
    for depth in (1, 3, None):
        be = _CountingSim(CostModel.h200(), seed=2, jitter=0.3)
        r = execute(mg, be, "event-driven", compute_depth=depth)
        assert sorted(r.finish_order) == list(range(len(mg.vertices)))
        most[depth] = be.most_in_flight
    assert most[1] == 1 and most[3] <= 3
    assert most[None] > 3  # else the limit shows nothing on this graph


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_compute_depth_must_be_a_positive_whole_number(bad):
    g = tiny_llama(parts=1)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    with pytest.raises(InvalidOptionError, match="compute_depth"):
        execute(mg, SimBackend(), "event-driven", compute_depth=bad)
