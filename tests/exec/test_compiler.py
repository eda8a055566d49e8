import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.exec.helpers import random_graph, tiny_llama
from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import ALIGN, compile_memory_graph, working_set
from vmstoolkit.exec.errors import BudgetTooSmallError, RaceError


def graphs():
    yield "llama", tiny_llama(parts=1)
    yield "llama-parts", tiny_llama(parts=2)
    yield "llama-2gpu", tiny_llama(parts=2, n_gpus=2, n_blocks=4)
    for s in range(3):
        yield f"random{s}", random_graph(s)


@pytest.mark.parametrize("name,g", list(graphs()))
def test_checker_accepts_compiled_graphs(name, g):
    ws = working_set(g)
    for frac in (1.0, 0.6, 0.35, 0.2):
        try:
            mg = compile_memory_graph(g, int(ws * frac))
        except BudgetTooSmallError:
            continue
        assert check_race_free(mg) > 0
        assert max(mg.peak_bytes) <= mg.budget
        for b in mg.buffers:
            assert b.offset % ALIGN == 0 and b.offset + b.size <= mg.budget


def test_full_budget_moves_nothing():
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, working_set(g))
    assert mg.offloaded_bytes == 0 and mg.reloaded_bytes == 0


def test_small_budget_offloads_activations():
    g = random_graph(1, n=40)
    mg = compile_memory_graph(g, 2 * max(map(g.vertex_bytes, g.vertices)))
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0
    check_race_free(mg)


@pytest.mark.parametrize("name,g", list(graphs()))
def test_checker_rejects_removed_reuse_edge(name, g):
    mg = compile_memory_graph(g, int(working_set(g) * 0.3))
    reuse = [e for e, k in mg.kinds.items() if k == "reuse"]
    assert reuse, "a small budget must reuse memory"
    for u, v in random.Random(0).sample(reuse, min(5, len(reuse))):
        saved = mg.preds[v]
        mg.preds[v] = [p for p in saved if p != u]
        with pytest.raises(RaceError):
            check_race_free(mg)
        mg.preds[v] = saved
    check_race_free(mg)


def test_checker_rejects_moved_buffer():
    """Moving one buffer onto another's live range is a race even if every edge is there."""
    g = tiny_llama()
    mg = compile_memory_graph(g, working_set(g))
    act = [b for b in mg.buffers if b.writer >= 0]
    a, b = act[0], act[1]  # both live at once: b is written while a is still to be read
    b.offset = a.offset
    with pytest.raises(RaceError):
        check_race_free(mg)


def test_transitive_reduction_drops_implied_edges():
    g = tiny_llama(parts=2)
    mg = compile_memory_graph(g, int(working_set(g) * 0.4))
    assert mg.n_edges < mg.edges_before_reduction
    # every kept edge is necessary: no other path from u to v
    for v, ps in enumerate(mg.preds):
        for u in ps:
            others = [p for p in ps if p != u]
            seen, stack = set(), list(others)
            while stack:
                x = stack.pop()
                if x == u:
                    pytest.fail(f"edge {u}->{v} is implied")
                if x in seen or x < u:
                    continue
                seen.add(x)
                stack.extend(mg.preds[x])


def test_budget_too_small_names_vertex_and_bytes():
    g = tiny_llama()
    biggest = max(g.vertices, key=g.vertex_bytes)
    need = g.vertex_bytes(biggest)
    with pytest.raises(BudgetTooSmallError) as e:
        compile_memory_graph(g, need // 2)
    assert e.value.needed >= need and e.value.budget == need // 2
    assert repr(e.value.vertex) in str(e.value) and str(e.value.needed) in str(e.value)


def random_schedule_live_bytes(mg, rng):
    """Play one random execution the graph allows (vertices start when their predecessors have
    ended, random durations) and check that the buffers alive at any instant fit in the budget
    and never overlap."""
    n = len(mg.vertices)
    succs = mg.succs()
    unsat = [len(p) for p in mg.preds]
    last_access = {}
    for b in mg.buffers:
        for u in b.last_accesses():
            last_access.setdefault(u, []).append(b.id)
    writes_of = {}
    for b in mg.buffers:
        if b.writer >= 0:
            writes_of.setdefault(b.writer, []).append(b.id)
    # a preloaded buffer nobody reads was dropped before the run needed its bytes: never live
    live = {b: mg.buffers[b] for b in mg.preloaded if mg.buffers[b].readers}
    t, running, done = 0.0, [], 0
    ready = [v for v in range(n) if unsat[v] == 0]
    peak = [0] * mg.n_gpus

    def check():
        by_gpu = {}
        for b in live.values():
            by_gpu.setdefault(b.gpu, []).append((b.offset, b.offset + b.size))
        for gpu, spans in by_gpu.items():
            spans.sort()
            assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), "overlap"
            used = sum(e - s for s, e in spans)
            assert used <= mg.budget
            peak[gpu] = max(peak[gpu], used)

    while done < n:
        rng.shuffle(ready)
        for v in ready:
            for b in writes_of.get(v, ()):
                live[b] = mg.buffers[b]
            running.append((t + rng.random(), v))
        ready = []
        check()
        running.sort()
        t, v = running.pop(0)
        done += 1
        for b in last_access.get(v, ()):
            # dead once all its last accesses ended
            if all(u in finished or u == v for u in mg.buffers[b].last_accesses()):
                live.pop(b, None)
        finished.add(v)
        for s in succs[v]:
            unsat[s] -= 1
            if unsat[s] == 0:
                ready.append(s)
    return peak


finished: set = set()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.sampled_from([0.2, 0.3, 0.5, 0.8]), st.integers(0, 3))
def test_budget_holds_in_any_order(seed, frac, which):
    g = random_graph(seed) if which < 2 else tiny_llama(parts=which - 1)
    try:
        mg = compile_memory_graph(g, int(working_set(g) * frac))
    except BudgetTooSmallError:
        return
    rng = random.Random(seed)
    for _ in range(3):
        finished.clear()
        random_schedule_live_bytes(mg, rng)
