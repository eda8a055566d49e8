"""``vmstoolkit compare`` (issue 21): two runs side by side, one run under two allocators, and the
allocation sites at the peak from the recorded frames."""

import json
import pickle

from typer.testing import CliRunner

from vmstoolkit.analysis.compare import peak_sites, site_of
from vmstoolkit.cli import app
from vmstoolkit.units import MiB

runner = CliRunner(env={"COLUMNS": "200"})
TORCH = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}


def frame(name, line):
    return [TORCH, {"filename": "/home/me/train.py", "line": line, "name": name}]


def snapshot(sizes):
    """Allocate each (site, size) in turn, then free everything: the peak holds all of them."""
    ev, addr = [], 1 << 32
    for i, (site, line, size) in enumerate(sizes):
        ev.append({"action": "alloc", "addr": addr + i * (1 << 30), "size": size, "stream": 0, "time_us": i,
                   "frames": frame(site, line)})
    ev += [{"action": "free_completed", "addr": e["addr"], "size": e["size"], "stream": 0, "time_us": 99} for e in ev]
    return {"device_traces": [ev], "segments": []}


def write(tmp_path, name, sizes):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(snapshot(sizes)))
    return p


def test_site_is_the_innermost_user_frame():
    assert site_of({"frames": frame("attn", 7)}) == "/home/me/train.py:7 (attn)"
    assert site_of({"frames": [TORCH]}).endswith("linear.py:125 (forward)")
    assert site_of({}) == "<no frames recorded>"


def test_peak_sites():
    peak, sites = peak_sites(snapshot([("a", 1, 100 * MiB), ("b", 2, 50 * MiB), ("a", 1, 10 * MiB)]))
    assert peak == 160 * MiB and sites == [("/home/me/train.py:1 (a)", 110 * MiB), ("/home/me/train.py:2 (b)", 50 * MiB)]


def test_two_runs_side_by_side(tmp_path):
    a = write(tmp_path, "a.pickle", [("x", 1, 100 * MiB), ("y", 2, 50 * MiB)])
    b = write(tmp_path, "b.pickle", [("x", 1, 100 * MiB), ("y", 2, 150 * MiB)])
    r = runner.invoke(app, ["compare", str(a), str(b), "-f", "json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]  # JSON Lines: the runs, then the sites
    ra, rb = [x for x in lines if x["kind"] == "run"]
    sites = [x for x in lines if x["kind"] == "site"]
    assert [x["kind"] for x in lines] == ["run", "run"] + ["site"] * len(sites)
    assert rb["peak_allocated_diff"] == 100 * MiB and ra["peak_allocated_diff"] == 0
    assert rb["peak_reserved_diff"] == rb["peak_reserved"] - ra["peak_reserved"] > 0
    assert sites[0] == {"kind": "site", "site": "/home/me/train.py:2 (y)", "a_bytes": 50 * MiB, "b_bytes": 150 * MiB}
    tab = runner.invoke(app, ["compare", str(a), str(b)])
    assert tab.exit_code == 0 and "train.py:2 (y)" in tab.stdout and "100.00 MiB" in tab.stdout


def test_one_run_under_two_allocators(tmp_path):
    a = write(tmp_path, "a.pickle", [("x", 1, 100 * MiB), ("y", 2, 50 * MiB)])
    r = runner.invoke(app, ["compare", str(a), "-a", "native", "-a", "vms", "-f", "json"])
    assert r.exit_code == 0, r.output
    runs = [x for x in map(json.loads, r.stdout.splitlines()) if x["kind"] == "run"]
    assert [x["allocator"] for x in runs] == ["native", "vms"]


def test_user_errors(tmp_path):
    a = write(tmp_path, "a.pickle", [("x", 1, MiB)])
    assert "two or more allocators" in runner.invoke(app, ["compare", str(a)]).output
    assert runner.invoke(app, ["compare", str(a), str(a), str(a)]).exit_code == 2
