"""What a run executed, step by step: ``CudaBackend(timeline=True).spans`` (CUDA events around
every vertex) and :func:`vmstoolkit.exec.plots.plot_schedule`, which draws them or the sim
backend's. The CUDA backend runs on Numba's CUDA simulator with a clocked fake of CUDA events
(``tests/gpu/test_timeline_gpu.py`` times a real GPU)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tests.exec.helpers import FakeHostMemory, tiny_llama, weighted_chain
from vmstoolkit.exec.backends.host_memory import PinnedPool
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, random_weights
from vmstoolkit.exec.plots import KIND_COLORS, plot_schedule, vertex_kind
from vmstoolkit.exec.train_graph import build_train_step, random_train_values


@pytest.fixture
def clocked_events(sim_gpu, monkeypatch):
    """CUDA events that record a tick of a shared clock (1 ms a record); counts timing events."""
    from numba import cuda

    ticks = itertools.count()
    made = []

    class Event:
        def __init__(self, timing):
            self.timing, self.t = timing, None
            made.append(self)

        def record(self, stream):
            self.t = float(next(ticks))

        def query(self):
            return True

        def wait(self, stream):  # the stream waits on this event: it must have been recorded
            assert self.t is not None, "waited on before it was recorded"

        def synchronize(self):
            assert self.t is not None, "synchronized before it was recorded"

        def elapsed_time(self, later):  # milliseconds, like numba's
            return later.t - self.t

    monkeypatch.setattr(cuda, "event", lambda timing=True: Event(timing))
    return made


def test_cuda_timeline_has_one_span_per_vertex_on_its_stream(clocked_events):
    from vmstoolkit.exec.backends.cuda import CudaBackend

    g = weighted_chain()
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    be = CudaBackend(random_weights(g, 0), timeline=True, pool=PinnedPool(FakeHostMemory()))
    try:
        execute(mg, be)
        spans = be.spans
    finally:
        be.close()
    assert sorted(s[0] for s in spans) == [v.id for v in mg.vertices]
    assert all(stream == mg.vertices[vid].stream and gpu == mg.vertices[vid].gpu for vid, gpu, stream, _, _ in spans)
    # each vertex sits between its two records (1 ms apart on the fake clock, the launch between),
    # measured from the first start
    assert spans[0][3] == 0.0 and all(np.isclose(b - a, 1e-3) for *_, a, b in spans)
    assert all(s[3] < t[3] for s, t in zip(spans, spans[1:]))  # launch order, strictly later


def test_no_timeline_records_no_timing_events(clocked_events):
    from vmstoolkit.exec.backends.cuda import CudaBackend

    g = weighted_chain()
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    be = CudaBackend(random_weights(g, 0), pool=PinnedPool(FakeHostMemory()))
    try:
        execute(mg, be)
        assert be.spans == []
    finally:
        be.close()
    assert clocked_events and not any(e.timing for e in clocked_events)


def test_schedule_figure_draws_every_span_in_its_lane_and_kind():
    tg = build_train_step(LlamaConfig(n_blocks=2, seq=8, hidden=32, heads=4, kv_heads=2, ffn=48), "full", rank=4)
    mg = compile_memory_graph(tg.graph, int(working_set(tg.graph) * 0.4))
    be = SimBackend(values=random_train_values(tg, 0), numerics=False)
    execute(mg, be)
    kinds = {vertex_kind(mg, vid) for vid, *_ in be.spans}
    # a full fine-tuning step under pressure does all five; compaction's moves happen only where
    # the budget holds every live tensor
    assert kinds == set(KIND_COLORS) - {"move"}
    ax = plot_schedule(mg, be.spans, title="one step")
    bars = ax.patches
    assert len(bars) == len(be.spans) and ax.get_title() == "one step"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == kinds
    lanes = dict(zip([t.get_text() for t in ax.get_yticklabels()], ax.get_yticks()))
    for bar, (vid, _, stream, start, end) in zip(bars, be.spans):
        assert bar.get_y() + bar.get_height() / 2 == pytest.approx(lanes[stream])
        assert bar.get_x() == pytest.approx(start * 1e3) and bar.get_width() == pytest.approx((end - start) * 1e3)


def test_a_prefill_schedule_names_only_what_it_ran():
    g = tiny_llama()
    mg = compile_memory_graph(g, int(working_set(g) * 0.3))
    be = SimBackend(values=random_weights(g, 0), numerics=False)
    execute(mg, be)
    ax = plot_schedule(mg, be.spans, unit="us")
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"forward", "offload", "reload"} - (
        set() if mg.offloaded_bytes else {"offload"})
    assert ax.get_xlabel() == "time (µs)"


def test_offload_experiment_saves_each_budgets_first_runs(tmp_path):
    from vmstoolkit.exec.experiment import run_offload_experiment

    cfg = LlamaConfig(n_blocks=2, seq=8, hidden=32, heads=4, kv_heads=4, ffn=48)
    rows = run_offload_experiment("sim", config=cfg, fractions=(0.5, 0.25), schedule_dir=tmp_path)
    budgets = sorted({r["budget"] for r in rows})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"schedule_{b}B.{ext}" for b in budgets for ext in ("json", "png"))
    for b in budgets:
        sched = json.loads((tmp_path / f"schedule_{b}B.json").read_text())
        made = {r["executor"]: r["makespan_s"] for r in rows if r["budget"] == b}
        assert {ex: sched[ex]["seconds"] for ex in made} == made  # repeats=1: the first run is the row's
