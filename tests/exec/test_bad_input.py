"""Impossible shapes and budgets are one-line VmsErrors naming the value (issue 15 items 13, 16)."""

import math

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.errors import VmsError
from vmstoolkit.exec.compiler import compile_memory_graph
from vmstoolkit.exec.errors import InvalidBudgetError, InvalidShapeError
from vmstoolkit.exec.experiment import run_offload_experiment
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, build_llama

TINY = dict(n_blocks=2, seq=16, ffn=128)


@pytest.mark.parametrize("kw,needle", [
    ({"hidden": 256, "heads": 3, "kv_heads": 3}, "hidden=256"),  # 85.33 features per head
    ({"hidden": 8, "heads": 16, "kv_heads": 16}, "hidden=8"),  # a head of 0 features
    ({"hidden": 100, "heads": 3, "kv_heads": 3}, "hidden=100"),
    ({"hidden": 60, "heads": 4, "kv_heads": 4}, "head_dim=15"),  # rotary embeddings rotate halves
    ({"hidden": 64, "heads": 4, "kv_heads": 3}, "kv_heads=3"),
    ({"hidden": 64, "heads": 4, "kv_heads": 4, "seq": 0}, "seq=0"),
    ({"hidden": 64, "heads": 4, "kv_heads": 4, "dtype": "float77"}, "float77"),
])
def test_impossible_llama_shapes_are_refused(kw, needle):
    cfg = {**TINY, **kw}
    with pytest.raises(InvalidShapeError, match=needle) as e:
        LlamaConfig(**cfg)
    assert isinstance(e.value, VmsError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def test_parts_that_do_not_divide_are_a_shape_error():
    with pytest.raises(InvalidShapeError, match="parts=3"):
        build_llama(LlamaConfig(**TINY, hidden=64, heads=4, kv_heads=4), parts=3)


def test_a_tensor_with_no_elements_is_refused():
    g = TaskGraph()
    with pytest.raises(InvalidShapeError, match=r"'x'.*\(4, 0\)"):
        g.tensor("x", (4, 0))


@pytest.mark.parametrize("budget", [math.nan, math.inf, -math.inf, -5, 0, 1000.5, "1GiB", True])
def test_budget_must_be_a_positive_whole_number_of_bytes(budget):
    with pytest.raises(InvalidBudgetError, match="budget") as e:
        compile_memory_graph(tiny_llama(), budget)
    assert repr(budget) in str(e.value) or str(budget) in str(e.value)


def test_integral_float_budget_is_taken():
    assert compile_memory_graph(tiny_llama(), 1e6).budget == 1_000_000


@pytest.mark.parametrize("frac", [math.nan, math.inf, 0.0, -0.5])
def test_experiment_refuses_bad_fractions_before_running(frac):
    with pytest.raises(InvalidBudgetError, match="fraction"):
        run_offload_experiment("sim", config=LlamaConfig(**TINY, hidden=64, heads=4, kv_heads=4), fractions=(frac,))
