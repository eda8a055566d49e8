"""``vmstoolkit experiment fragmentation`` through Typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["experiment", "fragmentation", *args])


def test_synthetic_traces_table_and_files(tmp_path):
    r = invoke("synthetic:zero", "synthetic:lora", "-a", "pytorch-caching", "-a", "pytorch-expandable",
               "--out", str(tmp_path), "--jobs", "1", "--timeline", "synthetic-lora-seed0")
    assert r.exit_code == 0, r.output
    assert "synthetic-zero-seed0" in r.output and "not recorded" in r.output
    assert {p.name for p in tmp_path.iterdir()} == {
        "fragmentation.csv", "fragmentation.json", "fragmentation.md", "utilization.png", "timeline-synthetic-lora-seed0.png"}
    doc = json.loads((tmp_path / "fragmentation.json").read_text())
    assert [row["workload"] for row in doc["rows"]] == ["synthetic-zero-seed0", "synthetic-lora-seed0"]


@pytest.mark.slow
def test_bundled_trace_with_vms_savings(tmp_path, traces_dir):
    from vmstoolkit.pools import allocator_names

    if "vms" not in allocator_names():
        pytest.skip("vms is not registered yet")
    r = invoke(str(traces_dir / "llama-lora.caching.pickle.gz"), "-a", "pytorch-caching", "-a", "vms",
               "--out", str(tmp_path), "--jobs", "2")
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "fragmentation.json").read_text())["rows"][0]
    assert row["workload"] == "llama-lora" and "vms_saved_vs_pytorch-caching.gib" in row
    assert row["recorded_caching_peak_reserved"] == 8990490624


@pytest.mark.parametrize("args, message, code", [
    (["-a", "nope"], "unknown allocator 'nope'", 2),
    (["synthetic:nope"], "unknown synthetic workload 'nope'", 2),
    (["/no/such/trace.pickle.gz"], "no such trace file", 1),
    (["synthetic:zero", "--timeline", "other"], "--timeline 'other'", 2),
    (["synthetic:zero", "--jobs", "0"], "--jobs must be at least 1", 2),
])
def test_user_errors(tmp_path, args, message, code):
    r = invoke(*args, "--out", str(tmp_path))
    assert r.exit_code == code
    assert message in r.output


def test_bad_trace_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.pickle.gz"
    bad.write_bytes(b"not a snapshot")
    r = invoke(str(bad), "-a", "pytorch-caching", "--out", str(tmp_path / "o"), "--jobs", "1")
    assert r.exit_code == 1 and "error:" in r.output and "Traceback" not in r.output
