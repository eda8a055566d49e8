"""Fragmentation analysis: rows, savings, CSV/JSON/Markdown, parallel jobs."""

from __future__ import annotations

import csv
import io
import json

import pytest

from vmstoolkit.analysis.fragmentation import (
    GiB, Job, fragmentation_rows, markdown_table, plan_jobs, rows_to_csv, run_jobs, savings, spec_workload,
    experiment_json, workload_name, write_outputs,
)
from vmstoolkit.trace.replay import ReplayResult


def fake(trace, allocator, reserved, allocated=10 * GiB):
    return ReplayResult(trace=trace, allocator=allocator, events=100, peak_allocated=allocated,
                        peak_reserved=reserved, oom=False, driver_calls={}, seconds=0.1)


def test_savings():
    assert savings(20 * GiB, 15 * GiB) == (5.0, 25.0)
    assert savings(10 * GiB, 12 * GiB) == (-2.0, -20.0)


def test_names():
    assert workload_name("llama-full.caching") == "llama-full"
    assert spec_workload("/x/llama-lora.caching.pickle.gz") == "llama-lora"
    assert spec_workload("synthetic:zero:2") == "synthetic-zero-seed2"


def test_rows_with_and_without_vms():
    results = [fake("w.caching", "pytorch-caching", 20 * GiB), fake("w.caching", "vms", 15 * GiB)]
    rows = fragmentation_rows(["/t/w.caching.pickle.gz"], ["pytorch-caching", "vms"], results)
    (r,) = rows
    assert r["workload"] == "w" and r["peak_allocated"] == 10 * GiB and not r["synthetic"]
    assert r["pytorch-caching.utilization"] == 0.5 and r["vms.utilization"] == pytest.approx(2 / 3, abs=1e-6)
    assert r["vms_saved_vs_pytorch-caching.gib"] == 5.0 and r["vms_saved_vs_pytorch-caching.pct"] == 25.0
    rows = fragmentation_rows(["/t/w.caching.pickle.gz"], ["pytorch-caching"], results[:1])
    assert not any(k.startswith("vms_saved") for k in rows[0])
    assert "vms saves" not in markdown_table(rows, ["pytorch-caching"])


def test_outputs_round_trip(tmp_path):
    results = [fake("synthetic-zero-seed0", a, r) for a, r in (("pytorch-caching", 12 * GiB), ("vms", 11 * GiB))]
    results[0].timeline = {"allocated": [1, 2, 3], "reserved": [2, 3, 3], "time_us": [0, 1, 2]}
    rows = fragmentation_rows(["synthetic:zero"], ["pytorch-caching", "vms"], results)
    assert rows[0]["synthetic"]
    parsed = list(csv.DictReader(io.StringIO(rows_to_csv(rows))))
    assert parsed[0]["workload"] == "synthetic-zero-seed0" and float(parsed[0]["vms_saved_vs_pytorch-caching.gib"]) == 1.0
    doc = json.loads(experiment_json(rows, results, allocators=["pytorch-caching", "vms"], command="c", machine="m"))
    assert doc["rows"] == json.loads(json.dumps(rows)) and "synthetic" in doc["synthetic_note"]
    assert "synthetic" in markdown_table(rows, ["pytorch-caching", "vms"])
    written = write_outputs(tmp_path, rows, results, allocators=["pytorch-caching", "vms"],
                            timeline_workload="synthetic-zero-seed0")
    names = sorted(p.name for p in written)
    assert names == ["fragmentation.csv", "fragmentation.json", "fragmentation.md",
                     "timeline-synthetic-zero-seed0.png", "utilization.png"]
    for p in written:
        assert p.stat().st_size > 0
    assert (tmp_path / "utilization.png").read_bytes()[:4] == b"\x89PNG"


def test_jobs_in_worker_processes_match_in_process():
    jobs = plan_jobs(["synthetic:recompute", "synthetic:lora"], ["pytorch-caching", "pytorch-expandable"],
                     timeline_workload="synthetic-lora-seed0")
    assert [j.timeline for j in jobs] == [False, False, True, True]
    done = []
    parallel = run_jobs(jobs, 2, on_done=lambda j, r: done.append(j))
    serial = run_jobs(jobs[:2], 1)
    assert len(done) == 4 and [r.allocator for r in parallel] == [j.allocator for j in jobs]
    assert [r.peak_reserved for r in parallel[:2]] == [r.peak_reserved for r in serial]
    assert parallel[2].timeline is not None and parallel[0].timeline is None
    assert isinstance(jobs[0], Job)


def test_a_synthetic_job_is_trace_runs_one_replay_job():
    from vmstoolkit.analysis.fragmentation import run_job
    from vmstoolkit.trace.run import replay_trace
    from vmstoolkit.trace.synthetic import synthetic_trace

    job = Job("synthetic:lora:3", "vms", options=(("reuse_max_ratio", 2),), capacity=64 * GiB)
    r = run_job(job)
    direct = replay_trace(synthetic_trace("lora", 3), "vms", capacity=64 * GiB, options={"reuse_max_ratio": 2})
    assert r.extra == {**direct.extra, "synthetic": True} and r.extra["paths"]  # the paths, as every replay job reports
    assert (r.peak_reserved, r.driver_calls, r.events) == (direct.peak_reserved, direct.driver_calls, direct.events)
