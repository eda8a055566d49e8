"""``vmstoolkit experiment train-offload``: the issue's JSON keys, both variants, a changing
length, and one-line errors."""

import json

import pytest

from typer.testing import CliRunner

from vmstoolkit.cli import app
from vmstoolkit.exec.train_experiment import ROW_KEYS

runner = CliRunner()
TINY = ["--blocks", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--rank", "4"]
KEYS = ["budget", "executor", "variant", "step_s", "lower_bound_s", "offloaded_bytes", "reloaded_bytes",
        "recomputed_flops", "plan_s", "max_abs_grad_err"]


def run(*args):
    return runner.invoke(app, ["experiment", "train-offload", *TINY, *args])


def test_json_rows_have_exactly_the_issue_keys():
    assert list(ROW_KEYS) == KEYS
    for variant in ("lora", "full"):
        res = run("--variant", variant, "--seq", "16", "--steps", "2", "--budget", "0.5", "--budget", "300KiB",
                  "--format", "json")
        assert res.exit_code == 0, res.output
        rows = [json.loads(line) for line in res.stdout.splitlines()]
        assert [(r["executor"], r["variant"]) for r in rows] == [
            ("event-driven", variant), ("fixed-order", variant)] * 2
        for r in rows:
            assert list(r) == KEYS
            assert r["step_s"] >= r["lower_bound_s"] > 0
            assert r["reloaded_bytes"] > 0 and r["recomputed_flops"] == 0
            assert r["max_abs_grad_err"] < 1e-3  # the numpy reference, on the sim backend
        assert rows[2]["budget"] == 300 * 1024


def test_recompute_flag_reports_rerun_flops():
    res = run("--variant", "full", "--seq", "8", "--steps", "2", "--budget", "0.25", "--recompute",
              "--format", "json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["recomputed_flops"] > 0 and r["max_abs_grad_err"] < 1e-3


def test_changing_lengths_and_csv():
    res = run("--seq-range", "8:40", "--steps", "6", "--budget", "0.5", "--format", "csv", "--no-check-grads")
    assert res.exit_code == 0, res.output
    head, *rows = res.stdout.splitlines()
    assert head.split(",") == KEYS and len(rows) == 2


def test_budget_below_one_vertex_is_one_line_naming_both_sizes():
    res = run("--seq", "16", "--budget", "1KiB")
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "needs" in lines[0] and "budget is 1024 bytes" in lines[0]
    assert "Traceback" not in res.output


def test_bad_arguments_are_one_line_errors():
    for args, msg in ((["--seq-range", "40:8"], "--seq-range takes A:B"),
                      (["--seq", "16", "--seq-range", "8:40"], "not both"),
                      (["--seq", "16", "--budget", "1.5"], "budget fraction must be in (0, 1]"),
                      (["--seq", "16", "--budget", "lots"], "budget 'lots'")):
        res = run(*args)
        assert res.exit_code != 0 and msg in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) == 1


def test_schedule_saves_each_budgets_last_step_under_both_executors(tmp_path):
    res = run("--variant", "full", "--seq", "16", "--steps", "2", "--budget", "0.5", "--budget", "0.25",
              "--format", "json", "--schedule", str(tmp_path / "sched"))
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert all(list(r) == KEYS for r in rows)  # the rows are unchanged by the option
    budgets = sorted({r["budget"] for r in rows})
    assert sorted(p.name for p in (tmp_path / "sched").iterdir()) == sorted(
        f"schedule_{b}B.{ext}" for b in budgets for ext in ("json", "png"))
    for b in budgets:
        sched = json.loads((tmp_path / "sched" / f"schedule_{b}B.json").read_text())
        assert sched["budget"] == b and set(sched) == {"budget", "event-driven", "fixed-order"}
        for ex in ("event-driven", "fixed-order"):
            spans = sched[ex]["spans"]
            assert spans and all(end >= start >= 0 for *_, start, end in spans)
            assert max(end for *_, end in spans) == pytest.approx(sched[ex]["seconds"], rel=0.2)
        assert (tmp_path / "sched" / f"schedule_{b}B.png").stat().st_size > 10_000


def test_no_budget_that_fits_exits_non_zero_naming_it():
    r = run("--budget", "1KiB")
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: no schedule fits:") and "1024 bytes" in last, last
