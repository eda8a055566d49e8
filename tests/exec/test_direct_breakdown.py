"""``direct_forward(breakdown=True)``: seconds per op kind of the direct run (the CUDA backend's
equality and speed reference). The simulator's events time nothing, so the figures are checked
through :func:`op_seconds` and the simulator run checks the shape of the answer."""

import numpy as np
import pytest

from vmstoolkit.exec.backends.cuda import direct_forward, op_seconds
from vmstoolkit.exec.graph import random_weights

from .helpers import random_graph, tiny_llama


def test_op_seconds_sums_per_op_kind_largest_first():
    g = tiny_llama(n_blocks=1)
    times = [0.001 * (i + 1) for i in range(len(g.vertices))]
    got = op_seconds(g, times)
    want: dict[str, float] = {}
    for v, t in zip(g.vertices, times):
        want[v.op] = want.get(v.op, 0.0) + t
    assert got == pytest.approx(want)
    assert list(got.values()) == sorted(got.values(), reverse=True)
    assert sum(got.values()) == pytest.approx(sum(times))


def test_op_seconds_refuses_a_wrong_count():
    g = tiny_llama(n_blocks=1)
    with pytest.raises(ValueError, match=f"2 vertex times for {len(g.vertices)} vertices"):
        op_seconds(g, [0.0, 0.0])


def test_direct_forward_breakdown_names_every_op_kind_and_keeps_outputs():
    g = random_graph(seed=3, n=8)  # rmsnorm, residual_add, swiglu: cheap in the simulator
    values = random_weights(g, seed=0)
    plain, _ = direct_forward(g, values, repeats=0)
    out, best, per_op = direct_forward(g, values, repeats=1, breakdown=True)
    assert set(per_op) == {v.op for v in g.vertices}
    assert best > 0
    for t in plain:
        np.testing.assert_array_equal(out[t], plain[t])


def test_direct_forward_says_where_its_host_time_went_and_can_read_nothing_back():
    g = random_graph(seed=3, n=8)
    timings: dict[str, float] = {}
    out, best = direct_forward(g, random_weights(g, seed=0), repeats=1, outputs=[], timings=timings)
    assert out == {} and best > 0
    assert set(timings) == {"upload_s", "warmup_s", "passes_s", "readback_s"}
    assert all(t >= 0 for t in timings.values()) and timings["passes_s"] >= best
