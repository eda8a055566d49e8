"""Sweep planning: grids, folders of snapshots, rows against the best."""

from __future__ import annotations

import doctest

import vmstoolkit.analysis.sweep as sweep
from vmstoolkit.analysis.sweep import SweepJob, expand_grid, plan_sweep, snapshot_paths, sweep_rows


def test_doctests():
    assert doctest.testmod(sweep).failed == 0


def test_empty_grid_is_one_run_with_defaults():
    assert expand_grid({}) == [{}]
    assert plan_sweep(["t.pickle"], ["vms", "gmlake"], {}) == [SweepJob("t.pickle", "vms"), SweepJob("t.pickle", "gmlake")]


def test_plan_order_and_options_are_sorted_pairs():
    jobs = plan_sweep(["a", "b"], ["vms"], {"z": [1, 2], "a": [True]}, capacity=80)
    assert [(j.trace, j.options) for j in jobs] == [
        ("a", (("a", True), ("z", 1))), ("a", (("a", True), ("z", 2))),
        ("b", (("a", True), ("z", 1))), ("b", (("a", True), ("z", 2)))]
    assert all(j.capacity == 80 for j in jobs)
    hash(jobs[0])


def test_a_folder_stands_for_its_snapshots(tmp_path):
    for name in ("b.pickle.gz", "a.pickle", "notes.txt", "c.pkl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub").mkdir()
    assert [p.name for p in snapshot_paths([tmp_path])] == ["a.pickle", "b.pickle.gz", "c.pkl"]
    assert snapshot_paths([tmp_path / "x.pickle"]) == [tmp_path / "x.pickle"]


def test_vs_best_ignores_oom_runs():
    rows = [{"trace": "t", "peak_reserved": 100, "oom": False}, {"trace": "t", "peak_reserved": 50, "oom": True},
            {"trace": "t", "peak_reserved": 125, "oom": False}, {"trace": "u", "peak_reserved": 7, "oom": True}]
    assert [r["vs_best"] for r in sweep_rows(rows)] == [1.0, None, 1.25, None]
