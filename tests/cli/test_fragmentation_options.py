"""Issue 21 on ``experiment fragmentation``: --capacity, -o, --baseline, self-describing rows, --out
checked before any replay, OOM status; issue 15 item 13 (--out errors)."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
from typer.testing import CliRunner

from vmstoolkit import __version__
from vmstoolkit.cli import app

runner = CliRunner(env={"COLUMNS": "250"})
TWO = ["synthetic:zero", "synthetic:lora"]


def invoke(*args):
    return runner.invoke(app, ["experiment", "fragmentation", *args, "--jobs", "1"])


def test_capacity_options_and_baseline(tmp_path):
    r = invoke(*TWO, "-a", "pytorch-caching", "-a", "pytorch-expandable", "-a", "vms", "--baseline", "pytorch-caching",
               "-o", "vms:reuse_max_ratio=2", "-o", "config=max_split_size_mb:128", "--capacity", "100GiB",
               "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "vms saves vs" in r.output and "pytorch-expandable saves vs" in r.output
    doc = json.loads((tmp_path / "fragmentation.json").read_text())
    row = doc["rows"][0]
    assert row["capacity"] == 100 << 30 and row["vmstoolkit"] == __version__ and row["source"] == "synthetic:zero"
    assert row["vms.options"] == "reuse_max_ratio=2.0"
    assert row["pytorch-caching.options"] == row["pytorch-expandable.options"] == "config=max_split_size_mb:128"
    assert "vms_saved_vs_pytorch-caching.gib" in row and "pytorch-expandable_saved_vs_pytorch-caching.gib" in row
    assert not any(k.startswith("pytorch-caching_saved") for k in row)
    assert doc["baseline"] == "pytorch-caching"
    rep = doc["replays"][0]  # every replay's flat row
    assert rep["capacity"] == 100 << 30 and "driver_calls.create" in rep and rep["source"] == "synthetic:zero"
    assert {x["options"] for x in doc["replays"] if x["allocator"] == "vms"} == {"reuse_max_ratio=2.0"}
    rows = list(csv.DictReader(io.StringIO((tmp_path / "fragmentation.csv").read_text())))
    assert rows[0]["capacity"] == str(100 << 30) and rows[0]["vms.options"] == "reuse_max_ratio=2.0"


def test_default_savings_are_the_published_ones(tmp_path):
    r = invoke("synthetic:zero", "-a", "pytorch-caching", "-a", "vms", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "fragmentation.json").read_text())["rows"][0]
    assert [k for k in row if "_saved_vs_" in k] == ["vms_saved_vs_pytorch-caching.gib", "vms_saved_vs_pytorch-caching.pct"]


def test_timeline_covers_every_workload(tmp_path):
    r = invoke(*TWO, "-a", "pytorch-caching", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "timeline.png").exists()


def test_oom_is_red_and_exits_with_the_documented_status(tmp_path):
    r = invoke("synthetic:zero", "-a", "pytorch-caching", "-a", "vms", "--capacity", "1GiB", "--out", str(tmp_path))
    assert r.exit_code == 3, r.output
    assert "OOM at event" in r.output
    row = json.loads((tmp_path / "fragmentation.json").read_text())["rows"][0]
    assert row["vms.oom"] is True and isinstance(row["vms.oom_event"], int)
    assert row["vms_saved_vs_pytorch-caching.gib"] is None  # no saving computed from an OOM
    assert invoke("synthetic:zero", "-a", "vms", "--capacity", "1GiB", "--out", str(tmp_path),
                  "--oom-exit-code", "0").exit_code == 0


def _readonly(path, monkeypatch):
    path.mkdir()
    path.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the check see what a user would
        import vmstoolkit.cli.common as common

        real = common.os.access
        monkeypatch.setattr(common.os, "access", lambda p, mode: False if str(p) == str(path) else real(p, mode))


@pytest.mark.parametrize("case, message", [
    ("file", "is a file, not a directory"),
    ("under_file", "which is a file"),
    ("readonly", "is not writable"),
])
def test_bad_out_is_refused_before_any_replay(tmp_path, monkeypatch, case, message):
    f = tmp_path / "f.txt"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "readonly": tmp_path / "ro" / "new"}[case]
    if case == "readonly":
        _readonly(tmp_path / "ro", monkeypatch)
    import vmstoolkit.analysis.fragmentation as frag

    monkeypatch.setattr(frag, "run_job", lambda job: pytest.fail("replayed before checking --out"))
    r = invoke("synthetic:zero", "-a", "vms", "--out", str(out))
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--baseline", "paged"], "--baseline 'paged' is not among the allocators"),
    (["-o", "reuse_max_ratio=abc"], "reuse_max_ratio must be a number, got 'abc'"),
    (["-o", "slack_pages=1"], "it is an option of paged"),
    (["--capacity", "0"], "--capacity must be positive"),
])
def test_user_errors(tmp_path, args, message):
    r = invoke("synthetic:zero", "-a", "vms", "--out", str(tmp_path), *args)
    assert r.exit_code == 2 and message in r.output
