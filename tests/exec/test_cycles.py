"""A memory graph with a cycle (only reachable by editing one) is refused, naming the cycle
(issue 15 item 15): the checker said "race on GPU -1 bytes [0, 0)" and the executor hung."""

import asyncio

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.errors import VmsError
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import CycleError, ExecError
from vmstoolkit.exec.executor import execute


def _cyclic():
    g = tiny_llama()
    mg = compile_memory_graph(g, working_set(g))
    # vertex 10 descends from vertex 3 (program order is topological): 10 -> 3 closes a cycle
    mg.preds[3] = [*mg.preds[3], 10]
    return mg


def _assert_names_cycle(e: CycleError, mg):
    msg = str(e)
    assert "cycle" in msg and "race" not in msg and "-1" not in msg
    assert e.vertices[0] == e.vertices[-1] and len(e.vertices) >= 3
    for a, b in zip(e.vertices, e.vertices[1:]):  # each step is an edge a -> b of the graph
        assert a in mg.preds[b]
    assert {3, 10} <= set(e.vertices)
    assert repr(mg.vertices[3].name) in msg and repr(mg.vertices[10].name) in msg


def test_checker_names_the_cycle():
    mg = _cyclic()
    with pytest.raises(CycleError) as ei:
        check_race_free(mg)
    _assert_names_cycle(ei.value, mg)


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_executor_refuses_a_cycle_before_running(executor):
    mg = _cyclic()

    async def bounded():
        from vmstoolkit.exec.executor import execute_async
        return await asyncio.wait_for(execute_async(mg, SimBackend(), executor), timeout=20)

    with pytest.raises(CycleError) as ei:
        asyncio.run(bounded())
    _assert_names_cycle(ei.value, mg)
    with pytest.raises(CycleError):
        execute(mg, SimBackend(), executor)


def test_self_loop_is_a_cycle():
    g = tiny_llama()
    mg = compile_memory_graph(g, working_set(g))
    mg.preds[5] = [*mg.preds[5], 5]
    with pytest.raises(CycleError, match="vertex 5"):
        check_race_free(mg)


def test_exec_errors_are_vms_errors():
    assert issubclass(ExecError, VmsError) and issubclass(CycleError, ExecError)


def test_a_backend_failure_ends_the_run_instead_of_hanging():
    """A backend whose drive loop fails (here: the sim backend finding nothing in flight) must
    end the run with its error, not leave the executor waiting for a completion forever."""
    g = tiny_llama()
    mg = compile_memory_graph(g, working_set(g))
    mg.preds[3] = [p for p in mg.preds[3]] + [len(mg.vertices) - 1]  # a cycle ...

    async def run():
        from vmstoolkit.exec import executor as ex

        be = SimBackend(seed=0)
        be.setup(mg)
        return await ex._run(mg, be, fixed_order=False, lookahead=True, copy_depth=2)  # ... unchecked

    with pytest.raises(RuntimeError, match="deadlock"):
        asyncio.run(asyncio.wait_for(run(), timeout=20))


def test_acyclic_graph_numbered_out_of_order_is_accepted():
    """Ids need not be a topological order (the fast path only accepts those that are)."""
    from types import SimpleNamespace

    from vmstoolkit.exec.dag import check_acyclic, topological_positions

    verts = [SimpleNamespace(name=n) for n in "abc"]
    mg = SimpleNamespace(preds=[[1], [], [0]], vertices=verts)  # 1 -> 0 -> 2
    check_acyclic(mg)
    pos = topological_positions(mg.preds)
    assert pos[1] < pos[0] < pos[2]
    mg.preds[1] = [2]  # 2 -> 1 closes 1 -> 0 -> 2 -> 1
    with pytest.raises(CycleError, match="'a'.*'c'|'c'.*'a'"):
        check_acyclic(mg)
