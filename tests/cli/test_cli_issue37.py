"""Issue 37 "The CLI", item by item: what a new user met in the first hour, each fixed.

In-process (CliRunner) on tiny snapshots where possible; the Ctrl-C checks, which need a real
process and signal, are in test_interrupt.py."""

from __future__ import annotations

import csv
import io
import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app
from vmstoolkit.units import MiB

runner = CliRunner(env={"COLUMNS": "200"})
ROOT = Path(__file__).resolve().parents[2]


def tiny(path: Path, sizes=(3 * MiB, 5 * MiB), *, double_alloc: bool = False) -> Path:
    """A snapshot that allocates ``sizes`` (all live at the peak), then frees them."""
    ev = [{"action": "alloc", "addr": (1 << 32) + i * (1 << 30), "size": s, "stream": 0} for i, s in enumerate(sizes)]
    if double_alloc:
        ev.append(dict(ev[0]))  # a second alloc at a live address: corrupt
    ev += [{"action": "free_completed", "addr": e["addr"], "size": e["size"], "stream": 0} for e in ev[:len(sizes)]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"device_traces": [ev], "segments": []}))
    return path


def one_error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    return lines[0]


def rows(r) -> list[dict]:
    assert r.exit_code == 0, r.output
    return [json.loads(x) for x in r.stdout.splitlines()]


# -- compare -f csv, and the one output rule ---------------------------------------------------
def test_compare_csv_is_csv_with_the_json_rows(tmp_path):
    a = tiny(tmp_path / "a.pickle")
    r = runner.invoke(app, ["compare", str(a), "-a", "native", "-a", "vms", "-f", "csv"])
    assert r.exit_code == 0, r.output
    table = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [x["kind"] for x in table][:2] == ["run", "run"] and [x["allocator"] for x in table[:2]] == ["native", "vms"]
    assert {x["kind"] for x in table[2:]} == {"site"}
    lines = rows(runner.invoke(app, ["compare", str(a), "-a", "native", "-a", "vms", "-f", "json"]))
    assert [x["kind"] for x in lines] == [x["kind"] for x in table]
    assert int(table[1]["peak_reserved"]) == lines[1]["peak_reserved"]


# -- replay DIR --------------------------------------------------------------------------------
def test_replay_takes_a_folder_as_sweep_does(tmp_path):
    tiny(tmp_path / "runs" / "b.pickle")
    tiny(tmp_path / "runs" / "a.pickle", sizes=(7 * MiB,))
    (tmp_path / "runs" / "notes.txt").write_text("not a snapshot")
    got = rows(runner.invoke(app, ["replay", str(tmp_path / "runs"), "-a", "native", "-f", "json"]))
    assert [Path(x["source"]).name for x in got] == ["a.pickle", "b.pickle"]
    (tmp_path / "empty").mkdir()
    line = one_error_line(runner.invoke(app, ["replay", str(tmp_path / "empty")]))
    assert "no snapshots" in line and str(tmp_path / "empty") in line


# -- sweep has replay's -o, --lenient, --oom-exit-code; duplicate names named -------------------
def test_sweep_takes_fixed_options_beside_the_grid(tmp_path):
    a = tiny(tmp_path / "a.pickle")
    got = rows(runner.invoke(app, ["sweep", str(a), "-a", "vms", "-o", "vms:coalesce=false",
                                   "-g", "stitched_prefix=true,false", "--jobs", "1", "-f", "json"]))
    assert [(x["option.coalesce"], x["option.stitched_prefix"]) for x in got] == [(False, True), (False, False)]
    line = one_error_line(runner.invoke(app, ["sweep", str(a), "-o", "coalesce=false",
                                              "-g", "coalesce=true,false"]))
    assert "coalesce" in line and "give it once" in line


def test_sweep_lenient_and_oom_exit_code(tmp_path):
    bad = tiny(tmp_path / "bad.pickle", double_alloc=True)
    r = runner.invoke(app, ["sweep", str(bad), "-a", "native", "--jobs", "1"])
    assert r.exit_code == 1 and "second alloc at live address" in r.output
    assert rows(runner.invoke(app, ["sweep", str(bad), "-a", "native", "--jobs", "1", "--lenient", "-f", "json"]))
    ok = tiny(tmp_path / "ok.pickle", sizes=(64 * MiB,))
    r = runner.invoke(app, ["sweep", str(ok), "-a", "native", "--capacity", "16MiB", "--jobs", "1", "-f", "json"])
    assert r.exit_code == 3 and json.loads(r.stdout)["oom"] is True
    r = runner.invoke(app, ["sweep", str(ok), "-a", "native", "--capacity", "16MiB", "--jobs", "1",
                            "--oom-exit-code", "0", "-f", "json"])
    assert r.exit_code == 0


def test_duplicate_trace_names_are_named(tmp_path):
    a, b = tiny(tmp_path / "a" / "run.pickle"), tiny(tmp_path / "b" / "run.pickle")
    line = one_error_line(runner.invoke(app, ["sweep", str(tmp_path / "a"), str(tmp_path / "b")]))
    assert "'run'" in line and str(a) in line and str(b) in line
    line = one_error_line(runner.invoke(app, ["experiment", "fragmentation", str(a), str(b), "--out",
                                              str(tmp_path / "out")]))
    assert "'run'" in line and str(a) in line and str(b) in line


# -- allocators NAME ----------------------------------------------------------------------------
def test_allocators_lists_defaults_and_one_allocators_options():
    r = runner.invoke(app, ["allocators"])
    assert r.exit_code == 0 and "stitch_min_bytes=512MiB" in r.stdout and "reuse_max_ratio=10" in r.stdout
    r = runner.invoke(app, ["allocators", "vms"])
    assert r.exit_code == 0, r.output
    for text in ("stitched_prefix", "true", "best-fit", "largest-first", "merge a freed primitive block"):
        assert text in r.stdout
    r = runner.invoke(app, ["allocators", "native"])
    assert r.exit_code == 0 and "no options" in r.stdout
    line = one_error_line(runner.invoke(app, ["allocators", "nope"]))
    assert "'nope'" in line and "vms" in line


# -- README's -o example changes the result; the option reaches the policy ----------------------
@pytest.mark.slow  # two replays of a bundled trace: the README's claim is about it
def test_reuse_max_ratio_is_applied_and_the_readme_example_changes_a_figure(traces_dir):
    from vmstoolkit.pools import make_allocator

    a = make_allocator("vms", reuse_max_ratio="2", stitched_prefix="false")
    assert a.policy.reuse_max_ratio == 2.0 and a.policy.stitched_prefix is False
    a.close()
    example = "-o vms:stitched_prefix=false,reuse_max_ratio=2"
    assert example in (ROOT / "README.md").read_text()
    ckpt = str(traces_dir / "llama-ckpt.caching.pickle.gz")
    base = rows(runner.invoke(app, ["replay", ckpt, "-a", "vms", "-o", "vms:stitched_prefix=false", "-f", "json"]))
    knob = rows(runner.invoke(app, ["replay", ckpt, "-a", "vms", *example.split(), "-f", "json"]))
    assert "reuse_max_ratio=2" in knob[0]["options"]
    assert knob[0]["peak_reserved"] != base[0]["peak_reserved"]
    assert knob[0]["paths.reuse_stitched"] > 0 == base[0]["paths.reuse_stitched"]


# -- the capacity understood, in the header ----------------------------------------------------
def test_capacity_is_printed_as_understood(tmp_path):
    a = tiny(tmp_path / "a.pickle")
    r = runner.invoke(app, ["replay", str(a), "-a", "native", "--capacity", "80GB"])
    assert r.exit_code == 0, r.output
    assert "Replay on 74.51 GiB (80 GB)" in r.stdout.splitlines()[0]
    r = runner.invoke(app, ["replay", str(a), "-a", "native", "--capacity", "80GiB"])
    assert "Replay on 80.00 GiB" in r.stdout and "GB)" not in r.stdout
    r = runner.invoke(app, ["compare", str(a), "-a", "native", "-a", "vms", "--capacity", "80GB"])
    assert "Compare on 74.51 GiB (80 GB)" in r.stdout
    r = runner.invoke(app, ["sweep", str(a), "-a", "native", "--capacity", "80GB", "--jobs", "1"])
    assert "Sweep on 74.51 GiB (80 GB)" in r.stdout


# -- output paths: made when missing, said where they went; no partial file ----------------------
def test_view_and_offload_make_missing_folders_and_say_where_they_wrote(tmp_path):
    a = tiny(tmp_path / "a.pickle")
    page = tmp_path / "no" / "such" / "r.html"
    r = runner.invoke(app, ["view", str(a), "-a", "native", "--out", str(page)])
    assert r.exit_code == 0 and page.is_file() and f"wrote {page}" in r.output, r.output
    fig = tmp_path / "not" / "yet" / "f.png"
    r = runner.invoke(app, ["experiment", "offload", "--blocks", "1", "--hidden", "64", "--heads", "2", "--ffn", "128",
                            "--seq", "16", "--budget", "1", "--figure", str(fig), "-f", "json"])
    assert r.exit_code == 0, r.output
    assert fig.is_file() and fig.read_bytes()[:4] == b"\x89PNG" and f"wrote {fig}" in r.output
    assert not [p for p in fig.parent.iterdir() if p != fig]  # no temporary file left beside it


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    """Ctrl-C while the page is written: one line, status 130, no (partial) report."""
    a = tiny(tmp_path / "a.pickle")
    page = tmp_path / "out" / "r.html"
    real = Path.write_text

    def half_then_interrupt(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", half_then_interrupt)
    r = runner.invoke(app, ["view", str(a), "-a", "native", "--out", str(page)])
    assert r.exit_code == 130 and r.output.strip() == "error: interrupted", r.output
    assert not page.exists() and not list(page.parent.iterdir())


def test_staged_dir_moves_nothing_when_interrupted(tmp_path):
    from vmstoolkit.cli.output import staged_dir

    out = tmp_path / "results"
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(out) as stage:
            (stage / "fragmentation.csv").write_text("a,b\n")
            raise KeyboardInterrupt
    assert not out.exists()
    with staged_dir(out) as stage:
        (stage / "fragmentation.csv").write_text("a,b\n")
    assert [p.name for p in out.iterdir()] == ["fragmentation.csv"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_main_jobs_default_folder_is_ignored_by_git():
    from vmstoolkit.cli.fragmentation import DEFAULT_OUT

    r = subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT}/fragmentation.csv"], cwd=ROOT)
    assert r.returncode == 0, f"git does not ignore ./{DEFAULT_OUT}"


# -- progress on stderr for sweep, compare and view ---------------------------------------------
class Recorder:
    """A stand-in for the progress bar that records how far each task got."""

    def __init__(self):
        self.tasks: dict[int, dict] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description, total=None, **kw):
        self.tasks[len(self.tasks)] = {"description": description, "total": total, "completed": 0, "updates": 0}
        return len(self.tasks) - 1

    def update(self, task, *, advance=None, completed=None, total=None, description=None, **kw):
        t = self.tasks[task]
        t["updates"] += 1
        if advance:
            t["completed"] += advance
        if completed is not None:
            t["completed"] = completed
        if total is not None:
            t["total"] = total

    def remove_task(self, task):
        self.tasks[task]["removed"] = True


@pytest.mark.parametrize("command", ["sweep", "compare", "view"])
def test_long_commands_show_progress(tmp_path, monkeypatch, command):
    import importlib

    a = tiny(tmp_path / "a.pickle")
    module = importlib.import_module(f"vmstoolkit.cli.{command}")
    rec = Recorder()
    monkeypatch.setattr(module, "progress_bar", lambda: rec)
    args = {"sweep": ["sweep", str(a), "-a", "native", "-a", "vms", "--jobs", "1"],
            "compare": ["compare", str(a), "-a", "native", "-a", "vms"],
            "view": ["view", str(a), "-a", "native", "--out", str(tmp_path / "r.html")]}[command]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert rec.tasks and all(t["updates"] > 0 for t in rec.tasks.values()), rec.tasks
    if command == "sweep":
        assert rec.tasks[0]["completed"] == rec.tasks[0]["total"] == 2


def test_an_option_that_cannot_act_is_said_so(tmp_path):
    """vms takes a cached stitched range as a prefix before it could reuse it whole, so with its
    default stitched_prefix=true, reuse_max_ratio does nothing: a note says so, on stderr."""
    a = tiny(tmp_path / "a.pickle")
    r = runner.invoke(app, ["replay", str(a), "-a", "vms", "-o", "vms:reuse_max_ratio=2", "-f", "json"])
    assert r.exit_code == 0 and "note: vms: reuse_max_ratio has no effect while stitched_prefix=true" in r.stderr
    assert json.loads(r.stdout)["options"] == "reuse_max_ratio=2.0"
    r = runner.invoke(app, ["replay", str(a), "-a", "vms", "-o", "vms:reuse_max_ratio=2,stitched_prefix=false"])
    assert r.exit_code == 0 and "note:" not in r.stderr
    r = runner.invoke(app, ["sweep", str(a), "-a", "gmlake", "-g", "reuse_max_ratio=1,2", "--jobs", "1"])
    assert r.exit_code == 0 and "note:" not in r.stderr  # gmlake: stitched_prefix=false by default
    r = runner.invoke(app, ["sweep", str(a), "-a", "vms", "-g", "reuse_max_ratio=1,2", "--jobs", "1"])
    assert r.stderr.count("note: vms: reuse_max_ratio has no effect") == 1
