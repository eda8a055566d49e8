"""Replay a training run's own memory history step by step, and check it against the GPU run.

    python experiments/train_steps_replay.py SNAPSHOT [--train-jsonl FILE --mode MODE]
        [--option KEY=VALUE[,KEY=VALUE...] ...] [--steps-per-round 6] [--rounds 3] [--shapes BxS,...] [--native] [--json]
    python experiments/train_steps_replay.py vmstoolkit/data/traces/llama-lora.caching.pickle.gz \
        --rounds 1 --shapes 8x384,4x2048,4x512,6x768,8x768,4x768      # a bundled trace, on any machine

``SNAPSHOT`` is one of ``train_llama_gpu.py --snapshots``' files (``train-VARIANT.pickle.gz``,
e.g. ``experiments/data/train-h200-run13/``). The steps are found by their first allocation, the
input ids (int64, batch x sequence) of the shapes ``train_llama_gpu.py`` draws
(``common.train_shapes``), or of ``--shapes`` (a bundled trace's steps are in its ``.json``).
The ``paged`` allocator (options as ``--option slack_pages=256``) replays the history on the
simulated driver; per step it prints the driver calls and the modelled driver time (the H200
per-call costs, ``common.COST_US``), then the peak reserved. With ``--train-jsonl`` (a
``train.jsonl`` of a run of the same variant) and ``--mode`` (its mode, e.g.
``paged:slack_pages=256``), it compares the calls per step and the peak with what the GPU run
recorded (from step 1: step 0 here also counts loading the model) and exits 1 when they differ.
``--native`` replays through the compiled hook that serves PyTorch (its Numba ``cfunc``s, here
on the simulated driver) instead of the Python allocator: the two decide alike, and a test holds
them to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import replay_steps, same_mode, train_shapes
from vmstoolkit.errors import VmsError
from vmstoolkit.pools.registry import parse_allocator_spec
from vmstoolkit.trace import load_trace

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--option", action="append", default=[], help="paged options, KEY=VALUE[,KEY=VALUE...]")
    ap.add_argument("--steps-per-round", type=int, default=6, help="steps of train_llama_gpu.py's plan per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=None, help="the steps of a round as BATCHxSEQ,... (default: train_llama_gpu.py's)")
    ap.add_argument("--native", action="store_true",
                    help="replay through the compiled hook that runs inside PyTorch (Numba cfuncs), not the Python allocator")
    ap.add_argument("--train-jsonl", type=Path, default=None)
    ap.add_argument("--mode", default=None, help="the GPU run's mode to compare with (paged options from it)")
    ap.add_argument("--json", action="store_true", help="also print the per-step figures as one JSON line")
    args = ap.parse_args()
    if args.train_jsonl is not None and args.mode is None:
        ap.error("--train-jsonl needs --mode: the GPU run's mode to compare with")
    try:
        plan = ([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes
                else train_shapes(args.steps_per_round))
        mode = args.mode or "paged"
        spec = parse_allocator_spec(mode + (("," if ":" in mode else ":") + ",".join(args.option) if args.option else ""))
        if spec.name != "paged":
            raise VmsError(f"--mode {args.mode!r}: this replay is of the paged allocator")
        options = spec.options
        r = replay_steps(load_trace(args.snapshot), options, plan, args.rounds, native=args.native)
    except (VmsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = " (compiled hook)" if args.native else ""
    print(f"paged {options or ''}{how} on {args.snapshot.name}: peak reserved {r['peak_reserved'] / 2**30:.2f} GiB")
    for k, (c, m, s) in enumerate(zip(r["driver_calls_per_step"], r["driver_ms_per_step"], r["syncs_per_step"])):
        print(f"  step {k:2d}: {c:6d} driver calls  {m:7.1f} ms  {s:3d} syncs")
    if args.json:
        print(json.dumps(r))
    if args.train_jsonl is None:
        return 0
    variant = args.snapshot.name.removeprefix("train-").split(".")[0]
    rows = [json.loads(x) for x in args.train_jsonl.read_text().splitlines() if x.strip()]
    gpu = next((r for r in rows if r.get("variant") == variant and "error" not in r
                and same_mode(r.get("mode", ""), args.mode)), None)
    if gpu is None:
        print(f"no run of {variant} in mode {args.mode!r} in {args.train_jsonl}", file=sys.stderr)
        return 2
    # step 0 differs by construction: the GPU run counts from its first step's ids on, this
    # replay also counts loading the model (the history's first events)
    n = len(r["driver_calls_per_step"])
    same_calls = gpu["driver_calls_per_step"][1:n] == r["driver_calls_per_step"][1:]
    same_peak = gpu["peak_reserved"] == r["peak_reserved"]
    print(f"GPU run: calls of steps 1-{n - 1} {'the same' if same_calls else 'DIFFER: ' + str(gpu['driver_calls_per_step'][1:n])}; "
          f"peak {gpu['peak_reserved'] / 2**30:.2f} GiB {'the same' if same_peak else 'DIFFERS'}")
    return 0 if same_calls and same_peak else 1


if __name__ == "__main__":
    raise SystemExit(main())
