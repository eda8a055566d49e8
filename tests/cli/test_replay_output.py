"""Issue 21: flat, self-describing replay rows in every format; OOM unmistakable; per-allocator
options; one-line errors for bad option values (issue 15 items 10 and 13)."""

import csv
import hashlib
import io
import json

import pytest
from typer.testing import CliRunner

from vmstoolkit import __version__
from vmstoolkit.cli import app
from tests.cli.helpers import run_cli

runner = CliRunner(env={"COLUMNS": "250"})
SAME_KEYS = ("trace", "source", "source_sha256", "device", "allocator", "options", "capacity", "vmstoolkit",
             "peak_allocated", "peak_reserved", "utilization", "oom", "oom_event", "oom_message")


def test_csv_of_allocators_with_different_counts_has_every_column(small_trace):
    # Before: ValueError: dict contains fields not in fieldnames: 'paths'
    r = runner.invoke(app, ["replay", str(small_trace), "-a", "pytorch-caching", "-a", "vms", "-f", "csv"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [x["allocator"] for x in rows] == ["pytorch-caching", "vms"]
    assert "paths.small" in rows[0] and rows[0]["paths.small"] == "" and int(rows[1]["paths.small"]) >= 0
    assert "driver_calls.create" in rows[0] and "driver_calls.mem_alloc" in rows[0]
    assert not any(v.startswith("{") for x in rows for v in x.values())  # no JSON packed into cells


def test_oom_and_fitting_rows_in_one_csv(small_trace):
    r = runner.invoke(app, ["replay", str(small_trace), "-a", "native", "-a", "vms", "--capacity", "100MiB",
                            "-f", "csv", "--oom-exit-code", "0"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert {x["oom"] for x in rows} == {"True"} and all(x["oom_event"] == "1" for x in rows)


def test_every_format_carries_the_same_self_describing_fields(small_trace):
    digest = hashlib.sha256(small_trace.read_bytes()).hexdigest()
    js = runner.invoke(app, ["replay", str(small_trace), "-a", "vms", "-a", "native", "-f", "json",
                             "-o", "vms:reuse_max_ratio=2", "--capacity", "1GiB"])
    cs = runner.invoke(app, ["replay", str(small_trace), "-a", "vms", "-a", "native", "-f", "csv",
                             "-o", "vms:reuse_max_ratio=2", "--capacity", "1GiB"])
    assert js.exit_code == cs.exit_code == 0, js.output + cs.output
    rows = [json.loads(line) for line in js.stdout.splitlines()]
    crows = list(csv.DictReader(io.StringIO(cs.stdout)))
    for row, crow in zip(rows, crows):
        assert set(SAME_KEYS) <= set(row) and set(row) == set(crow)  # JSON and CSV: the same flat columns
        assert not any(isinstance(v, dict) for v in row.values())
        assert row["source"] == str(small_trace) and row["source_sha256"] == digest
        assert row["capacity"] == 1 << 30 and row["vmstoolkit"] == __version__
        assert row["oom"] is False and row["oom_event"] is None
    assert rows[0]["options"] == "reuse_max_ratio=2.0" and rows[1]["options"] == ""
    tab = runner.invoke(app, ["replay", str(small_trace), "-a", "vms", "-o", "vms:reuse_max_ratio=2",
                              "--capacity", "1GiB"])
    assert tab.exit_code == 0
    for word in ("capacity", "1.00 GiB", "reuse_max_ratio=2.0", digest[:12], __version__):
        assert word in tab.stdout


def test_oom_rows_are_unmistakable_and_exit_with_the_documented_status(small_trace):
    args = ["replay", str(small_trace), "-a", "native", "--capacity", "100MiB"]
    r = runner.invoke(app, args)
    assert r.exit_code == 3
    assert "OOM at" in r.stdout and "event 1" in r.stdout and "yes" not in r.stdout
    assert "0.5" not in r.stdout  # no utilization beside it that looks like a result
    assert runner.invoke(app, args + ["--oom-exit-code", "0"]).exit_code == 0
    assert runner.invoke(app, args + ["--oom-exit-code", "7", "-f", "json"]).exit_code == 7


def test_table_fits_a_narrow_terminal(small_trace):
    r = CliRunner(env={"COLUMNS": "90"}).invoke(app, ["replay", str(small_trace), "-a", "vms", "-a", "pytorch-caching"])
    assert r.exit_code == 0 and max(len(line) for line in r.stdout.splitlines()) <= 90


def test_unprefixed_option_applies_where_valid(small_trace):
    # Before: -o reuse_max_ratio=2 went to pytorch-caching too and failed
    r = runner.invoke(app, ["replay", str(small_trace), "-a", "pytorch-caching", "-a", "vms", "-f", "json",
                            "-o", "reuse_max_ratio=2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["options"] for x in rows] == ["", "reuse_max_ratio=2.0"]


def _cli(*args):
    """Exit code and both streams, as a user sees them (run in this process: tests/cli/helpers.py)."""
    return run_cli(*args)


@pytest.mark.parametrize("alloc, opt", [
    ("vms", "coalesce=maybe"), ("vms", "stitched_prefix=2"), ("paged", "aliases=maybe"),
    ("vms", "reuse_max_ratio=nan"), ("vms", "reuse_max_ratio=inf"), ("vms", "reuse_max_ratio=abc"),
    ("gmlake", "max_cached_stitched=1.5"), ("vms", "small_size=1e30"), ("vms", "small_size=abc"),
    ("vms", "stitch_min_bytes=-5"), ("vms", "stitch_min_bytes=1.5"), ("vms", "stitch_min_bytes=abc"),
    ("paged", "max_blocks=-1"), ("paged", "max_blocks=0"), ("paged", "max_blocks=1"), ("paged", "max_blocks=2"),
])
def test_bad_option_values_are_one_line_errors_before_any_replay(small_trace, alloc, opt):
    r = _cli("replay", str(small_trace), "-a", alloc, "-o", opt)
    key, value = opt.split("=")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert key in r.stderr and repr(value) in r.stderr


def test_unknown_option_names_the_allocators_that_take_it(small_trace):
    r = _cli("replay", str(small_trace), "-a", "vms", "-o", "slack_pages=4")
    assert r.returncode == 2 and "it is an option of paged" in r.stderr


def test_paged_with_an_impossible_capacity_is_one_line(small_trace):
    r = _cli("replay", str(small_trace), "-a", "paged", "--capacity", "1024TiB")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "1024TiB" in r.stderr and "paged" in r.stderr


@pytest.mark.parametrize("command", [["replay", "/dev/zero", "-a", "vms"], ["compare", "/dev/zero", "/dev/zero"],
                                     ["experiment", "fragmentation", "/dev/zero", "-a", "vms"]])
def test_a_special_file_is_a_one_line_error_not_an_endless_read(command, tmp_path):
    """Issue 15 item 9: /dev/zero read without limit. The loader refused it, but the rows'
    SHA-256 of the source was computed first, and read /dev/zero forever."""
    import subprocess
    import sys

    if command[0] == "experiment":
        command = command + ["--out", str(tmp_path / "out")]
    r = subprocess.run([sys.executable, "-m", "vmstoolkit", *command], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "character device" in r.stderr and "Traceback" not in r.stderr
