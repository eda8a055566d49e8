import json
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from vmstoolkit.cli.offload import offload_command
from vmstoolkit.exec.experiment import run_offload_experiment
from vmstoolkit.exec.graph import LlamaConfig

TINY = LlamaConfig(n_blocks=3, seq=16, hidden=64, heads=4, kv_heads=4, ffn=128)
KEYS = {"budget", "executor", "makespan_s", "lower_bound_s", "offloaded_bytes", "fits_without_offload"}


def test_rows_have_the_required_fields():
    rows = run_offload_experiment("sim", 1, config=TINY, fractions=(1.0, 0.5, 0.01))
    ok = [r for r in rows if "error" not in r]
    assert len(ok) == 4 and {r["executor"] for r in ok} == {"event-driven", "fixed-order"}
    for r in ok:
        assert KEYS <= set(r)
        assert r["makespan_s"] >= r["lower_bound_s"] > 0
        assert r["fits_without_offload"] == (r["budget_fraction"] >= 1.0)
    bad = [r for r in rows if "error" in r]
    assert bad and all("no schedule fits" in r["error"] for r in bad)


def test_cli_json_and_table():
    app = typer.Typer()
    app.command()(offload_command)
    app.command("noop")(lambda: None)  # two commands: Typer keeps "offload_command" as a name
    args = ["offload-command", "--blocks", "2", "--seq", "16", "--hidden", "64", "--heads", "4", "--ffn", "128"]
    r = CliRunner().invoke(app, args + ["--format", "json", "--gpus", "2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert rows and all(KEYS <= set(x) for x in rows if "error" not in x)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "makespan against budget" in r.output
    from vmstoolkit.cli import app as vmstoolkit_app  # its one error handler prints the line

    r = CliRunner().invoke(vmstoolkit_app, ["experiment", "offload", *args[1:-2], "--ffn", "7", "--parts", "2"])
    assert r.exit_code == 1 and "error" in r.output


def test_gpu_script_dry_run(tmp_path):
    script = Path(__file__).resolve().parents[2] / "experiments" / "offload_gpu.py"
    p = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "offload.jsonl").read_text().splitlines()]
    runtime = [r for r in rows if r["kind"] == "runtime"]
    assert len(runtime) == 8 and all(r["equal"] for r in runtime)
    assert json.loads((tmp_path / "summary.json").read_text())["all_equal"]
    assert (tmp_path / "makespan.png").stat().st_size > 0


def test_cuda_backend_imports_without_gpu():
    import vmstoolkit.exec.backends.cuda as c

    assert c._c_strides((2, 3, 4), 4) == (48, 16, 4)


# -- issue 21: --budget, offloaded vs reloaded, reasons, the figure ------------------------------

def test_budget_specs_parse_sizes_and_fractions():
    import math
    import re

    import pytest

    from vmstoolkit.exec.errors import InvalidBudgetError
    from vmstoolkit.exec.experiment import BudgetSpec

    assert BudgetSpec.parse("12GiB") == BudgetSpec(nbytes=12 * 2**30)
    assert BudgetSpec.parse("4096B").resolve(10**9) == 4096
    assert BudgetSpec.parse("0.5") == BudgetSpec(fraction=0.5)
    assert BudgetSpec.parse("50%") == BudgetSpec(fraction=0.5)
    assert BudgetSpec.parse("1.5").resolve(1000) == 1500
    for bad in ("nan", "inf", "0", "-1", "0GiB", "abc", "12 parsecs", "4096", "50%%", "nan%"):
        with pytest.raises(InvalidBudgetError, match=re.escape(repr(bad))):
            BudgetSpec.parse(bad)
    assert not math.isnan(BudgetSpec.parse("1e-3").fraction)


def test_experiment_runs_the_budgets_given_in_order():
    from vmstoolkit.exec.experiment import BudgetSpec

    rows = run_offload_experiment("sim", 1, config=TINY, executors=("event-driven",),
                                  budgets=[BudgetSpec.parse("0.5"), BudgetSpec.parse("1MiB"), BudgetSpec.parse("100%")])
    ws = rows[0]["working_set"]
    assert [r["budget"] for r in rows] == [int(ws * 0.5), 2**20, ws]
    assert rows[1]["budget_fraction"] == 2**20 / ws and rows[1]["budget_spec"] == "1MiB"
    assert [r["fits_without_offload"] for r in rows] == [False, True, True]


def test_offloaded_counts_first_evictions_of_activations_only():
    """What the table's two columns mean, checked against the memory graph: "offloaded" is
    GPU -> host copies, made only for activations (weights and inputs have a host copy from the
    start, so dropping them copies nothing) and once per tensor; "reloaded" is host -> GPU
    copies, weights that did not fit at the start included. So offloaded 0.00 while reloaded
    climbs is right whenever only weights are dropped."""
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.graph import TensorKind, build_llama

    g = build_llama(TINY)
    ws = working_set(g)
    seen_zero_offload_with_reloads = False
    for frac in (0.75, 0.5, 0.3):
        mg = compile_memory_graph(g, int(ws * frac))
        offloads = [v for v in mg.vertices if v.kind == "offload"]
        assert all(g.tensors[v.tensor].kind is TensorKind.ACTIVATION for v in offloads)
        assert len({v.tensor for v in offloads}) == len(offloads)  # once per tensor
        assert mg.offloaded_bytes == sum(g.tensors[v.tensor].nbytes for v in offloads)
        assert mg.reloaded_bytes == sum(g.tensors[v.tensor].nbytes for v in mg.vertices if v.kind == "reload")
        seen_zero_offload_with_reloads |= mg.offloaded_bytes == 0 and mg.reloaded_bytes > 0
    assert seen_zero_offload_with_reloads


def test_no_schedule_rows_carry_their_reason():
    from vmstoolkit.exec.experiment import BudgetSpec

    rows = run_offload_experiment("sim", 1, config=TINY, budgets=[BudgetSpec.parse("16KiB")])
    assert all("no schedule fits" in r["error"] and "needs" in r["error"] for r in rows)


def test_figure_has_a_title_and_a_y_axis_that_does_not_start_at_zero(tmp_path):
    from vmstoolkit.exec.experiment import plot_makespan

    rows = run_offload_experiment("sim", 1, config=TINY, fractions=(1.0, 0.5, 0.25))
    fig = plot_makespan(rows, tmp_path / "m.png")
    ax = fig.axes[0]
    assert "LLaMA" in ax.get_title() and "3 blocks" in ax.get_title()
    lo, hi = ax.get_ylim()
    best = min(min(r["makespan_s"], r["lower_bound_s"]) for r in rows if "makespan_s" in r)
    assert 0 < lo <= best < hi
    assert (tmp_path / "m.png").stat().st_size > 0


# -- issue 19: the sweep the GPU scripts call --------------------------------------------------------


class Closing:
    """A backend that counts its closes (and can fail its run)."""

    def __init__(self, inner, log: list, fail: bool = False):
        self.inner, self.log, self.fail = inner, log, fail

    def __getattr__(self, name):
        if self.fail and name != "close":
            raise RuntimeError("the device fell over")
        return getattr(self.inner, name)

    def close(self):
        self.log.append("closed")
        self.inner.close()


def _sweep_setup():
    from vmstoolkit.exec.backends.sim import CostModel
    from vmstoolkit.exec.compiler import working_set
    from vmstoolkit.exec.graph import build_llama, random_weights
    from vmstoolkit.exec.ops import reference_forward

    graph = build_llama(LlamaConfig(n_blocks=2, seq=8, hidden=32, heads=4, kv_heads=4, ffn=48))
    values = random_weights(graph, 0)
    ref = reference_forward(graph, values)
    return graph, values, {t: ref[t] for t in graph.outputs}, working_set(graph), CostModel().lower_bound


def test_sweep_compares_every_run_with_the_reference_and_keeps_each_makespan():
    from vmstoolkit.exec.backends.sim import SimBackend
    from vmstoolkit.exec.experiment import sweep_budgets

    graph, values, ref, ws, lb = _sweep_setup()
    closed: list = []

    def make(rep):
        return Closing(SimBackend(seed=rep, jitter=0.05, numerics=True, values=values), closed)
    budgets = [({"name": "full"}, ws), ({"name": "half"}, ws // 2)]
    rows = list(sweep_budgets(graph, budgets, make, lb, repeats=3, reference=ref))
    assert [(r["name"], r["executor"]) for r in rows] == [("full", "event-driven"), ("full", "fixed-order"),
                                                         ("half", "event-driven"), ("half", "fixed-order")]
    assert len(closed) == 4 * 3
    for r in rows:
        assert len(r["makespans_s"]) == 3 and r["makespan_s"] == min(r["makespans_s"])
        assert r["equal"] and r["max_abs_err"] < 1e-4 and r["ref_max_abs"] > 0
        assert r["peak_bytes"] <= r.get("budget", ws)
    wrong = {t: a + 1.0 for t, a in ref.items()}
    bad = next(sweep_budgets(graph, budgets, make, lb, reference=wrong))
    assert not bad["equal"] and abs(bad["max_abs_err"] - 1.0) < 1e-3


def test_sweep_reads_back_only_the_runs_it_is_asked_to_check():
    from vmstoolkit.exec.backends.sim import SimBackend
    from vmstoolkit.exec.experiment import sweep_budgets

    graph, values, ref, ws, lb = _sweep_setup()
    reads: list = []

    def read(be):
        reads.append(be)
        return be.result()

    def make(rep):
        return SimBackend(seed=rep, numerics=True, values=values)
    rows = list(sweep_budgets(graph, [({}, ws // 2)], make, lb, repeats=3, reference=ref, read=read, check_runs=1))
    assert len(reads) == 2 and all(len(r["makespans_s"]) == 3 for r in rows)  # one read per executor
    assert all(r["equal"] and r["checked_runs"] == 1 for r in rows)
    rows = list(sweep_budgets(graph, [({}, ws // 2)], make, lb, repeats=2, reference=ref, read=read))
    assert len(reads) == 2 + 4 and all(r["checked_runs"] == 2 for r in rows)


def test_sweep_closes_a_failed_run_and_records_it_when_asked_to_keep_going():
    import pytest

    from vmstoolkit.exec.backends.sim import SimBackend
    from vmstoolkit.exec.experiment import sweep_budgets

    graph, values, ref, ws, lb = _sweep_setup()
    closed: list = []

    def make(rep):
        return Closing(SimBackend(seed=rep), closed, fail=True)
    with pytest.raises(RuntimeError, match="fell over"):
        list(sweep_budgets(graph, [({}, ws)], make, lb))
    assert closed == ["closed"]
    rows = list(sweep_budgets(graph, [({}, ws), ({}, 1)], make, lb, keep_going=True))
    assert [r["error"][:20] for r in rows[:2]] == ["RuntimeError: the de"] * 2 and "fell over" in rows[0]["traceback"]
    assert all("no schedule fits" in r["error"] for r in rows[2:]) and len(rows) == 4


def test_sweep_rows_say_where_the_host_time_went():
    # making backends, executing, checking and closing are timed apart: a slow check shows as
    # ``check`` (and none is counted when nothing is compared)
    import time

    from vmstoolkit.exec.backends.sim import SimBackend
    from vmstoolkit.exec.experiment import sweep_budgets

    graph, values, ref, ws, lb = _sweep_setup()

    def slow_read(be):
        time.sleep(0.05)
        return be.result()

    def make(rep):
        return SimBackend(seed=rep, numerics=True, values=values)
    rows = list(sweep_budgets(graph, [({}, ws // 2)], make, lb, repeats=2, reference=ref, read=slow_read, check_runs=1))
    for r in rows:
        assert set(r["host_s"]) == {"backend", "execute", "check", "close"}
        assert r["host_s"]["check"] >= 0.05 and all(v >= 0 for v in r["host_s"].values())
    rows = list(sweep_budgets(graph, [({}, ws // 2)], make, lb, repeats=2))
    assert all(r["host_s"]["check"] == 0 and r["host_s"]["execute"] > 0 for r in rows)


def test_points_below_a_measured_bound_are_called_out_not_drawn_under_a_lower_bound(tmp_path):
    """Issue 37: run 9's makespan plot showed points below its "lower bound" with no caveat (the
    compute term on a GPU is a measured direct forward, which the runtime beat by up to 2.7%)."""
    from vmstoolkit.exec.experiment import plot_makespan

    rows = [{"executor": "event-driven", "budget": b << 30, "makespan_s": m, "lower_bound_s": 0.333}
            for b, m in ((12, 0.3307), (6, 0.3243), (3, 0.3498))]
    labels = lambda fig: [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # noqa: E731
    fig = plot_makespan(rows, tmp_path / "m.png")
    assert "bound estimate: max(direct forward, copies)" in labels(fig) and "lower bound" not in labels(fig)
    assert any("2 points below the estimate" in t.get_text() for t in fig.axes[0].texts)
    above = [dict(r, makespan_s=max(r["makespan_s"], 0.334)) for r in rows]
    fig = plot_makespan(above, tmp_path / "m2.png")
    assert "lower bound" in labels(fig) and not fig.axes[0].texts
