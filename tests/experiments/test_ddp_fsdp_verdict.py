"""``experiments/ddp_fsdp_gpu.py``'s verdict, made from made-up rows (``--summary-of``: the runs
themselves need GPUs), and its checks of arguments, by running the script."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "ddp_fsdp_gpu.py"
CHECKS = ("history", "fraction", "oom_text", "graph_pool", "reduce_overhead", "reduce_overhead_training", "mempool")
CALL = "20261202T220000-1"


def _rows(mode, losses=(10.9, 10.8, 10.7), checks=None, ranks=(0,)):
    out = []
    for rank in ranks:
        for strategy in ("ddp", "fsdp2"):
            r = {"call": CALL, "repeat": 0, "variant": strategy, "mode": mode, "rank": rank, "world_size": len(ranks),
                 "warmup": 1, "step_times": [5.0, 0.1, 0.1], "losses": list(losses), "peak_reserved": 3 << 30,
                 "peak_allocated": 2 << 30}
            if strategy == "ddp":
                r["checks"] = checks if checks is not None else {n: {"ok": True} for n in CHECKS}
            out.append(r)
    return out


def _verdict(tmp_path, rows, exits, *more):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "exits.jsonl").write_text("".join(json.dumps({"call": CALL, "repeat": 0, **e}) + "\n" for e in exits))
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--summary-of", str(tmp_path / "train.jsonl"),
                           "--repeats", "1", *more], capture_output=True, text=True, timeout=120)


def test_a_clean_call_passes_at_world_size_one(tmp_path):
    modes = "default,paged:aliases=true,slack_pages=64"
    older = dict(_rows("default")[0], call="an-earlier-call", losses=[0.0, 0.0, 0.0])  # another call: not judged
    rows = [older] + _rows("default") + _rows("paged:aliases=True+slack_pages=64", losses=(10.9, 10.81, 10.7))
    p = _verdict(tmp_path, rows, [{"mode": "default", "returncode": 0}, {"mode": "paged:aliases=true,slack_pages=64", "returncode": 0}],
                 "--modes", modes, "--gpus", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1].startswith("ddp_fsdp_gpu: PASSED") and "1 ranks" in lines[-1]
    paged_ddp = next(x for x in lines if x.startswith("paged:aliases=true,slack_pages=64") and " ddp " in x)
    assert "checks 7/7 passed" in paged_ddp and "1.000x default" in paged_ddp and "0.01 of default" in paged_ddp


def test_every_failure_is_named_and_the_status_is_one(tmp_path):
    bad = {n: {"ok": True} for n in CHECKS}
    bad["fraction"] = {"ok": False, "refused": False}
    del bad["mempool"]
    rows = _rows("default", ranks=(0, 1)) + _rows("vms", checks=bad, ranks=(0,)) + _rows("paged", losses=(10.9, 12.0, 10.7), ranks=(0, 1))
    exits = [{"mode": "default", "returncode": 0}, {"mode": "vms", "returncode": 1, "cause": "RuntimeError: boom"},
             {"mode": "paged", "returncode": 0}]
    p = _verdict(tmp_path, rows, exits, "--modes", "default,vms,paged", "--gpus", "2")
    assert p.returncode == 1
    out = p.stdout
    assert "vms repeat 0: exit status 1 (RuntimeError: boom)" in out
    assert "vms repeat 0 rank 1 ddp: no result" in out and "vms repeat 0 rank 1 fsdp2: no result" in out
    assert 'check fraction failed: {"refused": false}' in out and "check mempool did not run" in out
    assert "paged ddp: losses 1.2 from default's (tolerance 0.05)" in out
    assert out.splitlines()[-1].startswith("ddp_fsdp_gpu: FAILED: vms repeat 0: exit status 1 (RuntimeError: boom) (and ")


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, named in ((("--checks", "history,nosuch"), "unknown check 'nosuch'"), (("--modes", "default,nosuch"), "nosuch")):
        p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and named in p.stderr.splitlines()[-1], p.stderr
