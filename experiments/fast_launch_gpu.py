"""The fast launch path (``vmstoolkit/kernels/_launch.py``) against Numba's launches, in one
process on a real GPU (issue 32: decode is host-bound).

Greedy generation of a checkpoint through the CUDA backend, with the wrapped kernels routed
through their plans (``on``) or through Numba (``off``, ``_launch.set_active(False)``), and with
``--driver-events`` a third mode, ``on+events`` (the plans, and the backend's events and copies
through the driver: ``VMSTOOLKIT_DRIVER_EVENTS=1``), in rounds that rotate the order, after one
warm run that compiles every kernel. Each row: the mode, the budget, prefill and decode seconds, the plan's vertices,
and the tokens (which must be the same in every mode). The summary gives, per budget, the median
decode seconds of each mode, and each mode's decode time over the one before it (on / off,
on+events / on) with a 95% interval from resampling the runs (``vmstoolkit.analysis.pooling``).

    python3 experiments/fast_launch_gpu.py --out DIR [--model DIR] [--new-tokens 64] [--rounds 4] [--driver-events] [--profile]
    python3 experiments/fast_launch_gpu.py --out DIR --from-jsonl RUN/fast_launch.jsonl     # summarize again, no GPU

The default model is the project's tiny LLaMA checkpoint (two blocks: every vertex is a few
microseconds of GPU work, so decode time is host time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize(rows: list[dict], modes: tuple, budgets) -> dict:
    """Per budget: each mode's median decode seconds, whether every run made the same tokens, and
    each mode's decode time over the one before it with a 95% interval (module docstring)."""
    from vmstoolkit.analysis.pooling import pooled

    summary = {}
    for b in budgets:
        by = {m: [r for r in rows if r["budget"] == b and r["mode"] == m] for m in modes}
        tokens = {json.dumps(r["tokens"]) for m in by for r in by[m]}
        med = {m: statistics.median(r["decode_s"] for r in by[m]) for m in by}
        verts = by["on"][0]["vertices"]
        summary[b] = {**{f"decode_s_{m}": med[m] for m in modes}, "same_tokens": len(tokens) == 1,
                      "vertices": verts, "runs_per_mode": len(by["on"])}
        # decode time of each mode over its base, with a 95% interval from resampling runs
        # (one process: the unit that varies here is a run, the GPU's and host's noise)
        runs = {m: [[r["decode_s"]] for r in by[m]] for m in modes}
        for base, mode in (("off", "on"), ("on", "on+events")):
            if mode in runs and len(runs[base]) > 1:
                pr = pooled([runs], base, mode)
                summary[b][f"{mode}_over_{base}"] = {"ratio": pr["ratio"], "interval_95": pr["interval_95"]}
                print(f"  decode {mode} / {base}: {pr['ratio']:.3f}, 95% interval "
                      f"{pr['interval_95'][0]:.3f}-{pr['interval_95'][1]:.3f} over {len(runs[base])} runs each")
        print(f"budget {b}: decode median " + ", ".join(f"{m} {med[m]:.4f} s" for m in modes)
              + f"; same tokens: {len(tokens) == 1}")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "checkpoints" / "llama-sharded")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budgets", nargs="+", default=["1.0", "0.25"])
    ap.add_argument("--driver-events", action="store_true", help="a third mode: the fast launches with the "
                    "backend's events and copies through the driver (VMSTOOLKIT_DRIVER_EVENTS=1)")
    ap.add_argument("--profile", action="store_true", help="then one more run (plans on) under cProfile: "
                    "DIR/profile.txt, the top functions by own and by cumulative time")
    ap.add_argument("--from-jsonl", type=Path, help="no GPU run: summarize the rows of an earlier run "
                    "(its fast_launch.jsonl) into DIR/summary.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if line.strip()]
        modes = tuple(dict.fromkeys(r["mode"] for r in rows))
        summary = summarize(rows, modes, list(dict.fromkeys(r["budget"] for r in rows)))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return 0 if all(v["same_tokens"] for v in summary.values()) else 1

    from vmstoolkit.exec.model.generate import run_generate
    from vmstoolkit.kernels import _launch as L

    modes = ("off", "on", "on+events") if args.driver_events else ("off", "on")

    def once(mode: str, warmup: bool) -> list[dict]:
        os.environ["VMSTOOLKIT_DRIVER_EVENTS"] = "1" if mode == "on+events" else "0"  # read by each backend made
        prev = L.set_active(mode != "off")
        n0 = L.fast_launch_count()
        t0 = time.perf_counter()
        try:
            rows = list(run_generate(args.model, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                     budgets=tuple(args.budgets), backend="cuda", warmup=warmup))
        finally:
            L.set_active(prev)
        wall = time.perf_counter() - t0
        planned = L.fast_launch_count() - n0
        return [{"mode": mode, "budget": r["budget_spec"], "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
                 "vertices": r["vertices"], "tokens": r["tokens"], "planned_launches": planned, "wall_s": wall}
                for r in rows]

    once("on", warmup=True)  # compiles every kernel, plans every signature
    rows = []
    for i in range(args.rounds):
        for mode in (modes[i % len(modes):] + modes[:i % len(modes)]):  # each round starts one mode later
            got = once(mode, warmup=False)
            rows += got
            for r in got:
                print(f"round {i} {mode:3s} budget {r['budget']:>5s}  prefill {r['prefill_s']:.4f} s  "
                      f"decode {r['decode_s']:.4f} s  planned launches {r['planned_launches']}", flush=True)
    with open(args.out / "fast_launch.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

    summary = summarize(rows, modes, args.budgets)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.profile:  # where the host time of a decode vertex goes, once the launch is cheap
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        once(modes[-1], warmup=False)
        prof.disable()
        buf = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(40)
        (args.out / "profile.txt").write_text(buf.getvalue())
        print(buf.getvalue()[:6000])
    return 0 if all(s["same_tokens"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
