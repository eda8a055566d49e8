"""execute / execute_async, and the schedule the sim backend records."""

import asyncio

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute, execute_async


def _mg(frac=0.5):
    g = tiny_llama(parts=2)
    return compile_memory_graph(g, max(int(working_set(g) * frac), 2 * max(map(g.vertex_bytes, g.vertices))))


def test_execute_async_on_a_running_loop_and_spans():
    mg = _mg()
    be = SimBackend(seed=0)

    async def main():
        return await execute_async(mg, be, "event-driven")

    r = asyncio.run(main())
    assert len(be.spans) == len(mg.vertices) == r.n_vertices
    assert {vid for vid, *_ in be.spans} == set(range(len(mg.vertices)))
    ends = {}
    for vid, gpu, stream, start, end in be.spans:
        assert 0 <= start < end <= r.makespan_s + 1e-12
        assert (gpu, stream) == (mg.vertices[vid].gpu, mg.vertices[vid].stream)
        ends[vid] = end
    for vid, gpu, stream, start, end in be.spans:  # no vertex starts before its inputs are done
        for p in mg.preds[vid]:
            if mg.vertices[p].stream != stream:
                assert start >= ends[p] - 1e-12
    busy = be.utilization(r.makespan_s)
    assert all(0 < v <= 1.0 for v in busy.values())


def test_execute_inside_a_running_loop_says_what_to_use():
    mg = _mg()

    async def main():
        execute(mg, SimBackend(seed=0))

    with pytest.raises(RuntimeError, match="await execute_async"):
        asyncio.run(main())


def test_unknown_executor():
    with pytest.raises(ValueError, match="unknown executor 'eager'"):
        execute(_mg(), SimBackend(seed=0), "eager")
