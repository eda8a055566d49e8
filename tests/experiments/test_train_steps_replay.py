"""``experiments/train_steps_replay.py`` on a bundled trace, run as a script: the steps are found,
the compiled hook replays as the Python allocator does, and a GPU run's figures are compared
whatever the spelling of its mode. (That the simulated driver gives the H200 runs' own driver
calls is the script's claim on ``experiments/data/``, made by its command in the results README.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "train_steps_replay.py"
TRACE = ROOT / "vmstoolkit" / "data" / "traces" / "llama-full.caching.pickle.gz"
SHAPES = "8x384,4x2048,4x512,6x768,8x768,4x768"  # the trace's steps (its .json)


def _run(*args, trace=TRACE):
    return subprocess.run([sys.executable, str(SCRIPT), str(trace), "--rounds", "1", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def python_replay():
    p = _run("--shapes", SHAPES, "--option", "aliases=true,slack_pages=64", "--json")
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_every_step_is_found_and_priced(python_replay):
    r = json.loads(python_replay.splitlines()[-1])
    assert len(r["driver_calls_per_step"]) == len(r["driver_ms_per_step"]) == 6
    assert sum(r["driver_calls_per_step"]) > 0 and r["peak_reserved"] > 0
    assert "step  5:" in python_replay


def test_the_compiled_hook_decides_as_the_python_allocator(python_replay):
    p = _run("--shapes", SHAPES, "--option", "aliases=true", "--option", "slack_pages=64", "--json", "--native")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[1:] == python_replay.splitlines()[1:]  # every step, and the figures
    assert "(compiled hook)" in p.stdout


def test_a_gpu_run_is_compared_whatever_the_spelling_of_its_mode(python_replay, tmp_path):
    r = json.loads(python_replay.splitlines()[-1])
    gpu = {"variant": "llama-full", "mode": "paged:aliases=True+slack_pages=64", **r}
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps({"variant": "llama-full", "mode": "default"}) + "\n" + json.dumps(gpu) + "\n")
    p = _run("--shapes", SHAPES, "--train-jsonl", str(jsonl), "--mode", "paged:aliases=true,slack_pages=64")
    assert p.returncode == 0 and "the same" in p.stdout and "DIFFER" not in p.stdout, p.stdout + p.stderr
    gpu["driver_calls_per_step"] = [c + 1 for c in r["driver_calls_per_step"]]
    jsonl.write_text(json.dumps(gpu) + "\n")
    p = _run("--shapes", SHAPES, "--train-jsonl", str(jsonl), "--mode", "paged:aliases=true,slack_pages=64")
    assert p.returncode == 1 and "DIFFER" in p.stdout


@pytest.mark.parametrize("args, message", [
    ((), "steps' input ids"),  # train_llama_gpu.py's plan is not this trace's
    (("--shapes", SHAPES, "--option", "slack_pages=lots"), "slack_pages must be an integer"),
    (("--shapes", SHAPES, "--mode", "vms"), "this replay is of the paged allocator"),
])
def test_what_cannot_be_replayed_is_one_error_line(args, message):
    p = _run(*args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
