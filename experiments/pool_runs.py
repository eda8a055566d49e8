"""Pool the step times of several training calls, for a claim no single call can carry.

    python experiments/pool_runs.py TRAIN_JSONL... --variant lora --mode paged:aliases=true,slack_pages=64
        [--base default] [--model llama3-1b] [--steps-per-round 6] [--resamples 10000]

Each ``train.jsonl`` is one call of ``train_llama_gpu.py``, its modes interleaved; every row is
one process. A host-bound step (LoRA: ``enqueue_times`` ~ ``step_times``) moves by ±10% from
one process to the next, so one call's few processes decide a 5% question badly. This pools the
steady-state steps (each process's rounds after the first) of every process of ``--mode`` and
of ``--base`` over all the calls (a mode matches however a call spelled it: the old ``+`` between
options is ``,``), and prints:

- per call, the ratio of the two pooled medians (the paired view: same machine, same hour);
- over all calls, the ratio of the pooled medians, with a 95% interval from resampling whole
  processes (a process, not a step, is the unit that varies), within each call;
- the per-process medians, so the spread is in view.

``--model`` keeps only that model's rows (``train_llama_gpu.py --model``; rows that name no model
are ``llama``'s); without it, every row of the variant counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import same_mode
from vmstoolkit.analysis.pooling import load, pooled, ratio


def spelled(path: Path, mode: str) -> str:
    """``mode`` as the call in ``path`` spelled it (the first row whose mode is the same)."""
    for line in path.read_text().splitlines():
        if line.strip() and same_mode(json.loads(line).get("mode", ""), mode):
            return json.loads(line)["mode"]
    return mode


def load_call(path: Path, variant: str, base: str, mode: str, steps_per_round: int,
              model: str | None = None) -> dict[str, list[list[float]]]:
    """``{base: [steady steps of each process], mode: [...]}`` of one call, whatever its spelling."""
    b, m = spelled(path, base), spelled(path, mode)
    got = load(path, variant, (b, m), steps_per_round, model)
    return {base: got[b], mode: got[m]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("train_jsonl", type=Path, nargs="+")
    ap.add_argument("--variant", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--base", default="default")
    ap.add_argument("--model", default=None, help="only this model's rows (default: every row of the variant)")
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--resamples", type=int, default=10000)
    args = ap.parse_args()
    calls = [load_call(p, args.variant, args.base, args.mode, args.steps_per_round, args.model)
             for p in args.train_jsonl]
    for p, c in zip(args.train_jsonl, calls):
        meds = {m: [round(statistics.median(x), 4) for x in ps] for m, ps in c.items()}
        r = f"{ratio(c[args.base], c[args.mode]):.3f}x" if c[args.base] and c[args.mode] else "-"
        print(f"{p}: {r}  per process {meds}")
    res = pooled(calls, args.base, args.mode, args.resamples)
    print(json.dumps({"variant": args.variant, **({"model": args.model} if args.model else {}), "base": args.base,
                      "mode": args.mode, **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
