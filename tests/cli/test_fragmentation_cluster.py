"""``vmstoolkit experiment fragmentation --cluster``: the same files as the local run."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner()
TRACES = Path(__file__).resolve().parents[2] / "vmstoolkit" / "data" / "traces"
# Two bundled traces: what costs is the workers' start, not the replays.
ARGS = ["experiment", "fragmentation", "-a", "pytorch-caching", "-a", "vms",
        *(str(TRACES / f"{w}.caching.pickle.gz") for w in ("llama-full", "llama-ckpt"))]


def test_local_cluster_writes_the_same_results_as_one_process(tmp_path):
    a, b = tmp_path / "local", tmp_path / "cluster"
    r = runner.invoke(app, [*ARGS, "--jobs", "1", "--out", str(a)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*ARGS, "--cluster", "local:2", "--out", str(b)])
    assert r.exit_code == 0, r.output
    for name in ("fragmentation.csv", "fragmentation.md"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ja, jb = (json.loads((d / "fragmentation.json").read_text()) for d in (a, b))
    assert ja["rows"] == jb["rows"] and len(ja["rows"]) == 2
    timing = ("seconds", "events_per_second")
    assert [{k: v for k, v in x.items() if k not in timing} for x in ja["replays"]] == \
        [{k: v for k, v in x.items() if k not in timing} for x in jb["replays"]]


def test_malformed_cluster_is_one_line_before_any_replay(tmp_path):
    r = runner.invoke(app, [*ARGS, "--cluster", "local:0", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "local:N" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
