"""The replay command: formats, and one-line errors with non-zero exits for bad input."""

import gzip
import json
import pickle

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app
from tests.cli.helpers import run_cli

runner = CliRunner(env={"COLUMNS": "200"})


def test_json_lines_have_the_documented_keys(traces_dir):
    # the smallest bundled trace (vms takes its small-pool path there 2,005 times)
    res = runner.invoke(app, ["replay", str(traces_dir / "llama-full.caching.pickle.gz"), "-a", "vms", "-a", "native", "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["allocator"] for r in rows] == ["vms", "native"]
    for r in rows:
        for key in ("trace", "allocator", "events", "peak_allocated", "peak_reserved", "utilization",
                    "fragmentation", "oom", "driver_calls", "seconds"):
            assert key in r
        assert r["trace"] == "llama-full.caching" and r["oom"] is False
    paths = {k: v for k, v in rows[0].items() if k.startswith("paths.")}  # vms says how it served the requests
    assert paths["paths.small"] > 0 and sum(paths.values()) == rows[0]["events"] - _frees(traces_dir)  # one path per alloc
    assert rows[0]["utilization"] > rows[1]["utilization"] - 1  # both real numbers


def _frees(traces_dir):
    from vmstoolkit.trace import load_trace

    t = load_trace(traces_dir / "llama-full.caching.pickle.gz")
    return sum(1 for e in t.alloc_free_events() if e.action.value != "alloc")


def test_table_and_csv(traces_dir):
    t = str(traces_dir / "llama-full.caching.pickle.gz")
    res = runner.invoke(app, ["replay", t, "-a", "gmlake"])
    assert res.exit_code == 0 and "gmlake" in res.stdout and "utilization" in res.stdout
    res = runner.invoke(app, ["replay", t, "-a", "vms", "--format", "csv", "--capacity", "40GiB"])
    assert res.exit_code == 0 and res.stdout.startswith("trace,source,source_sha256,device,allocator,options,capacity")


def test_capacity_oom(traces_dir):
    res = runner.invoke(app, ["replay", str(traces_dir / "llama-full.caching.pickle.gz"), "--capacity", "10GiB", "-f", "json"])
    assert res.exit_code == 3  # the documented status of an out-of-memory replay
    row = json.loads(res.stdout)
    assert row["oom"] is True and "out of memory" in row["oom_message"]


def _cli(*args):
    """Exit code and both streams, as a user sees them (run in this process: tests/cli/helpers.py)."""
    return run_cli(*args)


@pytest.mark.parametrize("make, match", [
    (lambda p: p.write_bytes(gzip.compress(b"garbage" * 10)[:20]), "truncated or corrupt gzip"),
    (lambda p: p.write_bytes(b"\x80\x04garbage"), "truncated or not a pickle"),
    (lambda p: p.write_bytes(pickle.dumps({"a": 1})), "not a PyTorch memory snapshot"),
])
def test_bad_files_give_one_line_and_exit_1(tmp_path, make, match):
    p = tmp_path / "bad.pickle.gz"
    make(p)
    r = _cli("replay", str(p))
    assert r.returncode == 1
    assert match in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, match", [
    (["-a", "nope"], "unknown allocator 'nope'"),
    (["--capacity", "-5GiB"], "--capacity"),
    (["--capacity", "0"], "--capacity must be positive"),
    (["--capacity", "lots"], "not a size: 'lots'"),
])
def test_bad_options(traces_dir, args, match):
    r = _cli("replay", str(traces_dir / "llama-lora.caching.pickle.gz"), *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


def test_double_free_in_a_snapshot_is_a_clear_error(tmp_path):
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 3 << 20},
                               {"action": "free_completed", "addr": 4096},
                               {"action": "free_completed", "addr": 4096}]]}
    p = tmp_path / "df.pickle"
    p.write_bytes(pickle.dumps(snap))
    r = _cli("replay", str(p), "-f", "json")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "double free of address 0x1000 at event 2 (already freed at event 1)" in r.stderr


@pytest.mark.parametrize("size, message", [
    (0, "allocation size must be positive, got 0"),
    (-4096, "event 0 has a negative size -4096 at 0x1000"),  # the loader's check, before any replay
])
def test_bad_sizes_in_a_snapshot_are_a_clear_error(tmp_path, size, message):
    p = tmp_path / "neg.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 4096, "size": size}]]}))
    r = _cli("replay", str(p))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_frees_from_before_recording_are_counted_not_errors(tmp_path):
    snap = {"device_traces": [[{"action": "free_completed", "addr": 8192},
                               {"action": "alloc", "addr": 4096, "size": 3 << 20}]]}
    p = tmp_path / "pre.pickle"
    p.write_bytes(pickle.dumps(snap))
    r = _cli("replay", str(p), "-f", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["events"] == 2


def test_allocator_options(traces_dir):
    t = str(traces_dir / "llama-ckpt.caching.pickle.gz")
    base = runner.invoke(app, ["replay", t, "-a", "vms", "-f", "json"])
    tuned = runner.invoke(app, ["replay", t, "-a", "vms", "-f", "json", "-o", "stitched_prefix=false", "-o", "reuse_max_ratio=10"])
    assert base.exit_code == tuned.exit_code == 0, tuned.output
    base, tuned = json.loads(base.stdout), json.loads(tuned.stdout)
    assert base["paths.prefix"] > 0 and tuned["paths.prefix"] == 0  # the options took effect
    assert tuned["paths.reuse_stitched"] > 0  # whole ranges up to 10x larger reused instead
    assert tuned["options"] == "stitched_prefix=false reuse_max_ratio=10.0" and base["options"] == ""
    assert tuned["utilization"] < base["utilization"] - 0.005  # which wastes what they do not need
    cfg = runner.invoke(app, ["replay", t, "-a", "pytorch-caching", "-f", "json", "-o", "config=max_split_size_mb:128"])
    assert cfg.exit_code == 0 and json.loads(cfg.stdout)["utilization"] < 0.7


@pytest.mark.parametrize("opt, match", [("nope=1", "unknown option 'nope'"), ("junk", "KEY=VALUE"),
                                        ("selection=random", "selection must be one of largest-first, best-fit"),
                                        ("vms:nope=1", "unknown stitch policy option 'nope'")])
def test_bad_allocator_options(traces_dir, opt, match):
    r = _cli("replay", str(traces_dir / "llama-lora.caching.pickle.gz"), "-a", "vms", "-o", opt)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


def _two_device_snapshot(tmp_path):
    dev = [{"action": "alloc", "addr": 4096, "size": 3 << 20}, {"action": "free_completed", "addr": 1 << 30, "size": 1 << 20},
           {"action": "alloc", "addr": 4096, "size": 1 << 20}]  # event 2: a second alloc at a live address
    p = tmp_path / "two.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [[dict(e) for e in dev[:2]], [], [dict(e) for e in dev[:2]]]}))
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"device_traces": [dev]}))
    return p, bad


def test_every_device_a_chosen_one_and_a_missing_one(tmp_path):
    p, _ = _two_device_snapshot(tmp_path)
    res = runner.invoke(app, ["replay", str(p), "-a", "vms", "-f", "json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["device"] for r in rows] == [0, 2]
    assert all(r["unmatched_frees"] == 1 and r["preexisting_bytes"] == 1 << 20 for r in rows)
    res = runner.invoke(app, ["replay", str(p), "-a", "vms", "-f", "json", "--gpu", "2"])
    assert [json.loads(line)["device"] for line in res.stdout.splitlines()] == [2]
    r = _cli("replay", str(p), "--gpu", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "device 1 has no 'alloc' events" in r.stderr
    r = _cli("replay", str(p), "--gpu", "7")
    assert r.returncode == 1 and "no device 7: it holds traces of devices 0..2 (with events: 0, 2)" in r.stderr


def test_corrupt_trace_fails_unless_lenient(tmp_path):
    _, bad = _two_device_snapshot(tmp_path)
    r = _cli("replay", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "second alloc at live address 0x1000 at event 2" in r.stderr
    res = runner.invoke(app, ["replay", str(bad), "-f", "json", "--lenient"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[0])["skipped_events"] == 1


def test_load_limits_are_flags(tmp_path, traces_dir):
    r = _cli("replay", str(traces_dir / "llama-full.caching.pickle.gz"), "--max-bytes", "1MiB")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "decompresses to more than 1.00 MiB" in r.stderr
    r = _cli("replay", str(traces_dir / "llama-full.caching.pickle.gz"), "--max-objects", "1000")
    assert r.returncode == 1 and "builds more than 1000 objects" in r.stderr
