"""The training script's summary, made again from made-up rows (``--summary-of``: the runs
themselves need a GPU), and its checks of arguments, by running the script."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "train_llama_gpu.py"


def _row(mode, repeat, times, peak, losses=(2.0, 1.0), **extra):
    return {"mode": mode, "variant": "lora", "repeat": repeat, "step_times": list(times), "losses": list(losses),
            "median_step_s": sorted(times[2:])[len(times[2:]) // 2], "peak_reserved": peak,
            "peak_allocated": peak // 2, "utilization": 0.5, **extra}


def _summary(tmp_path, rows, modes, *more):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--summary-of", str(jsonl), "--variants",
                        "lora", "--modes", modes, "--rounds", "2", "--steps-per-round", "2", *more],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return {s["mode"]: s for s in json.loads((out / "summary.json").read_text())["rows"]}


def test_repeats_pool_their_steady_steps_and_keep_the_highest_peak(tmp_path):
    # two rounds of two steps: the first round (warm-up, 9.0 s) is left out of every median; the
    # rows spell the mode with the old '+', the command with ','
    mode = "paged:aliases=True+slack_pages=64"
    rows = [_row("default", 0, [9.0, 9.0, 1.0, 1.0], 10),
            _row(mode, 0, [9.0, 9.0, 2.0, 2.0], 6, losses=(2.0, 1.25)),
            _row("default", 1, [9.0, 9.0, 1.0, 1.0], 10),
            _row(mode, 1, [9.0, 9.0, 1.0, 1.0], 8),
            {"mode": mode, "variant": "lora", "repeat": 2, "error": "crashed"}]
    out = _summary(tmp_path, rows, "default,paged:aliases=true,slack_pages=64")
    paged = out["paged:aliases=true,slack_pages=64"]
    assert out["default"]["median_step_s"] == 1.0 and out["default"]["step_time_vs_default"] == 1.0
    # pooled [2, 2, 1, 1]: median 1.5, not the median of the per-repeat medians' first
    assert paged["median_step_s"] == 1.5 and paged["step_time_vs_default"] == 1.5
    assert paged["repeats"] == 2  # the failed run is not counted
    assert paged["peak_reserved_GiB"] == 8 / 2**30
    assert paged["max_loss_diff_vs_default"] == 0.25
    assert paged["median_step_s_per_repeat"] == [2.0, 1.0]


def test_a_mode_without_a_default_run_has_no_ratio(tmp_path):
    (s,) = _summary(tmp_path, [_row("paged", 0, [9.0, 9.0, 2.0, 2.0], 6)], "default,paged").values()
    assert s["mode"] == "paged" and "step_time_vs_default" not in s


def test_host_times_are_pooled_like_step_times_when_every_repeat_has_them(tmp_path):
    rows = [_row("default", 0, [9.0, 9.0, 1.0, 1.0], 10, enqueue_times=[5.0, 5.0, 0.5, 0.7],
                 cpu_times=[8.0, 8.0, 1.0, 3.0]),
            _row("default", 1, [9.0, 9.0, 1.0, 1.0], 10, enqueue_times=[5.0, 5.0, 0.9, 0.9],
                 cpu_times=[8.0, 8.0, 1.0, 1.0]),
            _row("paged", 0, [9.0, 9.0, 1.0, 1.0], 6)]  # an older row without them
    out = _summary(tmp_path, rows, "default,paged")
    assert out["default"]["median_enqueue_s"] == 0.8  # of [0.5, 0.7, 0.9, 0.9]; warm-up left out
    assert out["default"]["median_cpu_s"] == 1.0
    assert "median_enqueue_s" not in out["paged"]


def test_bad_modes_and_more_cpus_than_cores_are_refused_before_any_run(tmp_path):
    for args, message in ((["--modes", "default,paged:slack_pages=lots"], "slack_pages must be an integer"),
                          (["--modes", "default,nope"], "unknown allocator 'nope'"),
                          (["--cpus", "100000"], "--cpus 100000: only")):
        p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert not (tmp_path / "train.jsonl").exists()
