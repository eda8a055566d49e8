"""``train_llama_gpu.py --model``: each model's plan of shapes (``--plan``, run as a script: the
training itself needs a GPU), the refusal of models and variants it does not have, and summaries
that keep to one model's rows."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "train_llama_gpu.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _plan(model, rounds=3, steps=6):
    p = _run("--model", model, "--plan", "--rounds", str(rounds), "--steps-per-round", str(steps))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_large_vocabulary_decoder_draws_every_step_afresh_and_the_same_in_every_call():
    plan = _plan("llama3-1b")
    assert plan == _plan("llama3-1b")  # seeded: every mode's process trains these shapes
    assert "vocab_size 128256" in plan["about"] and "num_key_value_heads 8" in plan["about"]
    steps = [tuple(s) for r in plan["shapes"] for s in r]
    assert len(plan["shapes"]) == 3 and len(steps) == 18
    assert all(b in (4, 6, 8) and 200 <= t <= 2048 for b, t in steps)
    assert len({t for _, t in steps}) >= 15  # sequence lengths change from step to step, round to round
    assert plan["shapes"][1] != plan["shapes"][0]


def test_the_held_out_decoder_is_the_issues_qwen2_shape_with_its_sequence_lengths():
    plan = _plan("qwen2-heldout")
    about = plan["about"]
    for part in ("hidden_size 1536", "num_hidden_layers 12", "num_key_value_heads 2", "vocab_size 151936"):
        assert part in about, about
    steps = [tuple(s) for r in plan["shapes"] for s in r]
    assert all(b in (4, 6, 8) and 317 <= t <= 2048 for b, t in steps)
    assert len({t for _, t in steps}) >= 15 and plan["shapes"][1] != plan["shapes"][0]


def test_the_traces_llama_stays_the_default_and_repeats_its_round():
    p = _run("--plan", "--rounds", "2", "--steps-per-round", "6")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["model"] == "llama" and plan["variants"] == ["full", "ckpt", "lora", "offload"]
    assert plan["shapes"][0] == plan["shapes"][1]  # the same round again, as the traces' runs trained
    assert all(b in (4, 6, 8) and 256 <= t <= 2048 and t % 128 == 0 for b, t in plan["shapes"][0])


def test_vision_models_draw_their_batch_per_step():
    for model in ("resnet50", "vit-b16"):
        plan = _plan(model, rounds=2, steps=8)
        batches = [b for r in plan["shapes"] for b, side in r]
        assert all(64 <= b <= 192 for b in batches) and len(set(batches)) > 8
        assert {side for r in plan["shapes"] for _, side in r} == {224}
        assert plan["variants"] == ["full"]


def test_unknown_models_and_their_missing_variants_are_refused_before_any_run(tmp_path):
    for args, message in ((["--model", "qwen2"], "--model 'qwen2': not one of llama, llama3-1b, qwen2-heldout, resnet50, vit-b16"),
                          (["--model", "resnet50", "--variants", "lora"], "--model resnet50: no variant 'lora'"),
                          (["--model", "llama3-1b", "--variants", "full,offload"], "no variant 'offload'")):
        p = _run("--out", str(tmp_path), *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert not (tmp_path / "train.jsonl").exists()


def test_a_summary_keeps_to_its_models_rows(tmp_path):
    def row(mode, model, t, peak):
        r = {"mode": mode, "variant": "full", "repeat": 0, "step_times": [9.0, 9.0, t, t], "losses": [1.0, 1.0],
             "median_step_s": t, "peak_reserved": peak, "peak_allocated": peak // 2, "utilization": 0.5}
        return {**r, "model": model} if model else r  # a row from before models were named is llama's

    jsonl = tmp_path / "train.jsonl"
    rows = [row("default", None, 1.0, 10), row("default", "llama3-1b", 2.0, 40), row("paged", "llama3-1b", 2.2, 30)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for model, want in (("llama3-1b", {"default": 2.0, "paged": 2.2}), ("llama", {"default": 1.0})):
        out = tmp_path / model
        p = _run("--model", model, "--out", str(out), "--summary-of", str(jsonl), "--variants", "full",
                 "--modes", "default,paged", "--rounds", "2", "--steps-per-round", "2")
        assert p.returncode == 0, p.stderr
        got = json.loads((out / "summary.json").read_text())["rows"]
        assert {s["mode"]: s["median_step_s"] for s in got} == want and {s["model"] for s in got} == {model}
