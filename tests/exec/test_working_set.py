"""``working_set`` (a gallop and a bisection over the 1% walk's candidates) returns what the
1% walk returned, on every graph the tests use, in O(log) compiles."""

from __future__ import annotations

import math

import pytest

from tests.exec import test_compiler_golden as golden_cases
from tests.exec.model.helpers import NAMES
from tests.exec.test_budget_monotone import GRAPHS, _generate, _lora
from vmstoolkit.exec import compiler
from vmstoolkit.exec.compiler import align, compile_memory_graph, working_set


def walk_working_set(graph) -> tuple[int, int]:
    """The reference: the walk ``working_set`` was until issue 32 was fixed (up from the
    unconstrained peak in 1% steps, one compile each), and how many candidates it tried."""
    total = sum(align(t.nbytes) for t in graph.tensors)
    b = max(compile_memory_graph(graph, total, check_budget=False).peak_bytes)
    tried = 0
    while True:
        tried += 1
        mg = compile_memory_graph(graph, b, check_budget=False)
        if mg.offloaded_bytes == 0 and mg.reloaded_bytes == 0:
            return b, tried
        b = align(int(b * 1.01) + 1)


ALL = {
    **GRAPHS,
    **{f"golden-{k}": v for k, v in golden_cases.GRAPHS.items()},
    **{f"{n}-gen7/6": _generate(n, 7, 6) for n in NAMES},
    **{f"{n}-gen8/64": _generate(n) for n in NAMES},
    **{f"{n}-lora": _lora(n) for n in NAMES},
}


@pytest.mark.parametrize("name", ALL)
def test_working_set_is_the_walks_in_logarithmic_compiles(name, monkeypatch):
    g = ALL[name]()
    want, tried = walk_working_set(g)
    calls = []
    real = compiler.compile_memory_graph
    monkeypatch.setattr(compiler, "compile_memory_graph", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    assert working_set(g) == want
    # one compile when the live peak is enough, else a gallop then a bisection
    assert len(calls) <= 1 + 2 * math.ceil(math.log2(tried + 1)), (tried, calls)
