"""The event-driven executor's bookkeeping grows linearly with the graph (issue 15 item 14).

Time is measured by ``benchmarks/offload_executor_scale.py``; here the work is counted: every
operation on the executor's ready queues, which was quadratic (copies held back by the copy
depth were popped and pushed again on every completion).
"""

import heapq
import types

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec import executor as ex_mod
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph
from vmstoolkit.exec.executor import execute


def _counting_heapq(counter):
    def wrap(f):
        def g(*a):
            counter[0] += 1
            return f(*a)
        return g
    return types.SimpleNamespace(heappush=wrap(heapq.heappush), heappop=wrap(heapq.heappop),
                                 heapify=heapq.heapify, heappushpop=wrap(heapq.heappushpop),
                                 heapreplace=wrap(heapq.heapreplace))


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_ready_queue_work_is_linear_in_vertices(monkeypatch, executor):
    per_vertex = []
    for blocks in (20, 80):
        g = tiny_llama(n_blocks=blocks)
        mg = compile_memory_graph(g, sum(t.nbytes for t in g.tensors) // 4)  # many reloads
        counter = [0]
        monkeypatch.setattr(ex_mod, "heapq", _counting_heapq(counter))
        execute(mg, SimBackend(seed=0, jitter=0.05), executor)
        per_vertex.append(counter[0] / len(mg.vertices))
    # a push and a pop per vertex, and a few more per completion for the streams' order
    assert per_vertex[1] < 12, per_vertex
    assert per_vertex[1] <= 1.5 * per_vertex[0] + 1, per_vertex
