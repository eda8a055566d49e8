"""The training script's summary, on made-up rows (the runs themselves need a GPU)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "train_llama_gpu.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_llama_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(mode, repeat, times, peak, losses=(2.0, 1.0)):
    return {"mode": mode, "variant": "lora", "repeat": repeat, "step_times": list(times), "losses": list(losses),
            "median_step_s": sorted(times[2:])[len(times[2:]) // 2], "peak_reserved": peak,
            "peak_allocated": peak // 2, "utilization": 0.5}


def test_repeats_pool_their_steady_steps_and_keep_the_highest_peak(train):
    # two rounds of two steps: the first round (warm-up, 9.0 s) is left out of every median
    rows = [_row("default", 0, [9.0, 9.0, 1.0, 1.0], 10),
            _row("paged", 0, [9.0, 9.0, 2.0, 2.0], 6, losses=(2.0, 1.25)),
            _row("default", 1, [9.0, 9.0, 1.0, 1.0], 10),
            _row("paged", 1, [9.0, 9.0, 1.0, 1.0], 8),
            {"mode": "paged", "variant": "lora", "repeat": 2, "error": "crashed"}]
    out = {s["mode"]: s for s in train.summarize(rows, ["lora"], ["default", "paged"], rounds=2, steps_per_round=2)}
    assert out["default"]["median_step_s"] == 1.0 and out["default"]["step_time_vs_default"] == 1.0
    # pooled [2, 2, 1, 1]: median 1.5, not the median of the per-repeat medians' first
    assert out["paged"]["median_step_s"] == 1.5 and out["paged"]["step_time_vs_default"] == 1.5
    assert out["paged"]["repeats"] == 2  # the failed run is not counted
    assert out["paged"]["peak_reserved_GiB"] == 8 / 2**30
    assert out["paged"]["max_loss_diff_vs_default"] == 0.25
    assert out["paged"]["median_step_s_per_repeat"] == [2.0, 1.0]


def test_a_mode_without_a_default_run_has_no_ratio(train):
    rows = [_row("paged", 0, [9.0, 9.0, 2.0, 2.0], 6)]
    (s,) = train.summarize(rows, ["lora"], ["default", "paged"], rounds=2, steps_per_round=2)
    assert s["mode"] == "paged" and "step_time_vs_default" not in s


def test_mode_options_parse_to_their_types(train):
    assert train.vms_options("paged:aliases=True+slack_pages=64+placement=best-fit+reuse_max_ratio=1.5") == {
        "aliases": True, "slack_pages": 64, "placement": "best-fit", "reuse_max_ratio": 1.5}
    assert train.vms_options("vms") == {}


def test_host_times_are_pooled_like_step_times_when_every_repeat_has_them(train):
    rows = [dict(_row("default", 0, [9.0, 9.0, 1.0, 1.0], 10), enqueue_times=[5.0, 5.0, 0.5, 0.7],
                 cpu_times=[8.0, 8.0, 1.0, 3.0]),
            dict(_row("default", 1, [9.0, 9.0, 1.0, 1.0], 10), enqueue_times=[5.0, 5.0, 0.9, 0.9],
                 cpu_times=[8.0, 8.0, 1.0, 1.0]),
            _row("paged", 0, [9.0, 9.0, 1.0, 1.0], 6)]  # an older row without them
    out = {s["mode"]: s for s in train.summarize(rows, ["lora"], ["default", "paged"], rounds=2, steps_per_round=2)}
    assert out["default"]["median_enqueue_s"] == 0.8  # of [0.5, 0.7, 0.9, 0.9]; warm-up left out
    assert out["default"]["median_cpu_s"] == 1.0
    assert "median_enqueue_s" not in out["paged"]


def test_cpus_one_per_core_the_gpus_own_first(train):
    # 8 CPUs, 4 cores with two threads each (cpu c and c + 4 share a core); the GPU is local to 2, 3, 6, 7
    core_of = {c: (0, c % 4) for c in range(8)}
    assert train.pick_cpus(2, set(range(8)), core_of, {2, 3, 6, 7}) == [2, 3]
    assert train.pick_cpus(3, set(range(8)), core_of, {2, 3, 6, 7}) == [0, 2, 3]  # then the others
    assert train.pick_cpus(2, {1, 5, 6}, core_of, set()) == [1, 6]  # 5 shares 1's core
    with pytest.raises(ValueError, match="only 4 physical cores"):
        train.pick_cpus(5, set(range(8)), core_of, set())
