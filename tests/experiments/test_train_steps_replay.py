"""The simulated driver against the H200: replaying a training run's own memory history through
``paged`` gives the driver calls the GPU run made, step by step, and its peak."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results" / "train-h200"


@pytest.fixture(scope="module")
def steps():
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location("train_steps_replay", ROOT / "experiments" / "train_steps_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gpu_run(name, variant, mode):
    for line in (RESULTS / name).read_text().splitlines():
        r = json.loads(line)
        if r["variant"] == variant and r["mode"] == mode:
            return r
    raise LookupError(f"{variant} {mode} in {name}")


@pytest.mark.parametrize("run, mode, options", [
    ("run11-paged-slack256-train.jsonl", "paged:slack_pages=256", {"placement": "best-fit", "slack_pages": 256}),
    ("run16-aliases-lora-train.jsonl", "paged:aliases=True+slack_pages=64", {"aliases": True, "slack_pages": 64}),
])
def test_lora_replay_makes_the_gpu_runs_driver_calls(steps, run, mode, options):
    from vmstoolkit.trace import load_trace

    gpu = _gpu_run(run, "lora", mode)
    r = steps.replay_steps(load_trace(RESULTS / "run13-snapshots" / "train-lora.pickle.gz"), options)
    assert r["peak_reserved"] == gpu["peak_reserved"]
    # from step 1 on (the replay's step 0 also loads the model)
    assert r["driver_calls_per_step"][1:] == gpu["driver_calls_per_step"][1:18]
    assert sum(r["driver_calls_per_step"][1:]) > 0  # the comparison has something to compare


def test_a_history_of_other_shapes_is_refused_by_name(steps):
    from vmstoolkit.trace import load_trace

    with pytest.raises(ValueError, match="steps' input ids"):
        steps.replay_steps(load_trace(ROOT / "vmstoolkit" / "data" / "traces" / "llama-lora.caching.pickle.gz"), {})


@pytest.mark.parametrize("options", [{}, {"aliases": True, "slack_pages": 64}], ids=["defaults", "aliases-slack64"])
def test_the_compiled_hook_decides_as_the_python_allocator(steps, options):
    # ckpt: the variant whose GPU runs the replay does not match exactly; the two implementations
    # (the cfuncs PyTorch calls, and the Python allocator the replays use) agree call for call
    from vmstoolkit.trace import load_trace

    trace = load_trace(RESULTS / "run13-snapshots" / "train-ckpt.pickle.gz")
    python = steps.replay_steps(trace, options)
    native = steps.replay_steps(trace, options, native=True)
    assert native == python
    assert sum(python["driver_calls_per_step"][1:]) > 0 and python["peak_reserved"] > 0
