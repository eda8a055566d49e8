"""``vmstoolkit sweep``: a grid of allocator options, checked before any replay, locally or on a cluster."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner()
LORA = "llama-lora.caching.pickle.gz"
# The sweeps that replay run on the smallest bundled trace (22,677 allocs and frees against the
# LoRA trace's 49,489): the grid, its rows and the cluster's are the same code whatever the trace.
FULL = "llama-full.caching.pickle.gz"


def rows_of(r):
    assert r.exit_code == 0, r.output
    return [json.loads(x) for x in r.stdout.splitlines()]  # notes (stderr) apart


def test_grid_runs_every_combination(traces_dir):
    r = runner.invoke(app, ["sweep", str(traces_dir / FULL), "-a", "vms", "-g", "reuse_max_ratio=1,2",
                            "-g", "stitched_prefix=true,false", "--jobs", "1", "-f", "json"])
    rows = rows_of(r)
    assert [(x["option.reuse_max_ratio"], x["option.stitched_prefix"]) for x in rows] == \
        [(1, True), (1, False), (2, True), (2, False)]
    assert min(x["vs_best"] for x in rows) == 1.0 and all(x["trace"] == "llama-full.caching" for x in rows)


def test_cluster_gives_the_same_rows(traces_dir):
    args = ["sweep", str(traces_dir / FULL), "-a", "vms", "-a", "pytorch-caching", "-f", "json"]
    local = rows_of(runner.invoke(app, [*args, "--jobs", "1"]))
    remote = rows_of(runner.invoke(app, [*args, "--cluster", "local:2"]))
    strip = lambda rows: [{k: v for k, v in x.items() if k != "seconds"} for x in rows]  # noqa: E731
    assert strip(local) == strip(remote) and len(local) == 2


@pytest.mark.parametrize("args,needle", [
    (["-a", "pytorch-caching", "-g", "reuse_max_ratio=1,2"], "pytorch-caching"),  # not its option
    (["-a", "vms", "-g", "bogus=1"], "bogus"),
    (["-a", "vms", "-g", "reuse_max_ratio"], "KEY=VALUE"),
    (["-a", "vms", "-g", "reuse_max_ratio=1,,2"], "empty value"),
    (["-a", "vms", "-g", "reuse_max_ratio=1,1"], "twice"),
    (["-a", "nope"], "nope"),
    (["-a", "vms", "--cluster", "local:0"], "local:N"),
])
def test_bad_sweeps_fail_in_one_line_before_replaying(traces_dir, args, needle):
    r = runner.invoke(app, ["sweep", str(traces_dir / LORA), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.output


def test_a_folder_without_snapshots(tmp_path):
    r = runner.invoke(app, ["sweep", str(tmp_path)])
    assert r.exit_code == 2 and "no snapshots" in r.output
