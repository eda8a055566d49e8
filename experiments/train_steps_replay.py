"""Replay a training run's own memory history step by step, and check it against the GPU run.

    python experiments/train_steps_replay.py SNAPSHOT [--train-jsonl FILE --mode MODE]
        [--option KEY=VALUE ...] [--steps-per-round 6] [--native]

``SNAPSHOT`` is one of ``train_llama_gpu.py --snapshots``' files (``train-VARIANT.pickle.gz``,
e.g. ``experiments/results/train-h200/run13-snapshots/``). The steps are found by their first
allocation, the input ids of the shapes ``train_llama_gpu.shapes`` draws (int64, batch x
sequence). The ``paged`` allocator (options as ``--option slack_pages=256``) replays the history
on the simulated driver; per step it prints the driver calls and the modelled driver time (the
H200 per-call costs of ``experiments/vms_policy.py``), then the peak reserved. With
``--train-jsonl`` (a ``train.jsonl`` of a run of the same variant) and ``--mode`` (its mode, e.g.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llama_gpu import shapes, vms_options  # noqa: E402
from vms_policy import COST_US, SET_ACCESS_US_PER_CHUNK, _AccessMeter  # noqa: E402

from vmstoolkit.pools import make_allocator, make_driver  # noqa: E402
from vmstoolkit.trace import load_trace  # noqa: E402


def step_starts(events, steps_per_round: int, rounds: int) -> list[int]:
    """Index of each step's first event: the allocation of its input ids, in the plan's order."""
    sizes = [b * s * 8 for b, s in shapes(steps_per_round)] * rounds
    starts, j = [], 0
    for i, e in enumerate(events):
        if j < len(sizes) and e.action.value == "alloc" and e.size == sizes[j]:
            starts.append(i)
            j += 1
    if j < len(sizes):
        raise ValueError(f"found {j} of {len(sizes)} steps' input ids: not a train_llama_gpu.py run of "
                         f"{rounds} rounds of {steps_per_round} steps")
    return starts


class _Hook:
    """The compiled hook PyTorch runs (:mod:`vmstoolkit.integrations.native_torch`), on ``driver``,
    behind the allocator interface the replay uses."""

    def __init__(self, driver, options: dict) -> None:
        from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN, make_handle

        self._hook = make_handle("paged", driver_factory=lambda device: driver, **options)
        self._alloc, self._free = ALLOC_FN(self._hook.alloc_ptr), FREE_FN(self._hook.free_ptr)
        self._sizes: dict[int, int] = {}

    def allocate(self, size: int, stream: int = 0) -> int:
        ptr = self._alloc(size, 0, None)
        if not ptr:
            raise RuntimeError(f"the hook failed to allocate {size} bytes: {self._hook.last_error}")
        self._sizes[ptr] = size
        return ptr

    def free(self, ptr: int, stream: int | None = None) -> None:
        self._free(ptr, self._sizes.pop(ptr), 0, stream)

    def peak_reserved(self) -> int:
        return self._hook.bridge(0).allocator.driver.peak_physical_bytes

    def close(self) -> None:
        self._hook.close()


def replay_steps(trace, options: dict, steps_per_round: int = 6, rounds: int = 3, native: bool = False) -> dict:
    """Per step: driver calls, modelled driver milliseconds and synchronizations; and the peak.
    ``native``: through the compiled hook that runs inside PyTorch, not the Python allocator."""
    events = trace.alloc_free_events()
    starts = step_starts(events, steps_per_round, rounds)
    driver = make_driver("sim")
    meter = _AccessMeter(driver)
    alloc = _Hook(driver, options) if native else make_allocator("paged", driver, **options)
    bounds = starts[1:] + [len(events)]
    live: dict[int, int] = {}
    calls, ms, syncs = [], [], []
    i = 0
    try:
        for end in bounds:  # the events before the first step's ids (model and optimizer) count in step 1
            before = (dict(driver.calls), meter.chunks, driver.syncs)
            for e in events[i:end]:
                if e.action.value == "alloc":
                    live[e.addr] = alloc.allocate(e.size, e.stream)
                elif e.addr in live:
                    alloc.free(live.pop(e.addr))
            i = end
            delta = {k: v - before[0].get(k, 0) for k, v in driver.calls.items()}
            calls.append(sum(delta.values()))
            ms.append((sum(COST_US.get(k, 0.0) * v for k, v in delta.items())
                       + SET_ACCESS_US_PER_CHUNK * (meter.chunks - before[1])) / 1000)
            syncs.append(driver.syncs - before[2])
        peak = alloc.peak_reserved() if native else alloc.stats().peak_reserved_bytes
    finally:
        alloc.close()
    return {"driver_calls_per_step": calls, "driver_ms_per_step": ms, "syncs_per_step": syncs, "peak_reserved": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--option", action="append", default=[], help="a paged option, KEY=VALUE")
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--native", action="store_true",
                    help="replay through the compiled hook that runs inside PyTorch (Numba cfuncs), not the Python allocator")
    ap.add_argument("--train-jsonl", type=Path, default=None)
    ap.add_argument("--mode", default=None, help="the GPU run's mode to compare with (paged options from it)")
    args = ap.parse_args()
    options = vms_options(args.mode) if args.mode else {}
    options.update(vms_options("paged:" + "+".join(args.option)))
    r = replay_steps(load_trace(args.snapshot), options, args.steps_per_round, args.rounds, native=args.native)
    how = " (compiled hook)" if args.native else ""
    print(f"paged {options or ''}{how} on {args.snapshot.name}: peak reserved {r['peak_reserved'] / 2**30:.2f} GiB")
    for k, (c, m, s) in enumerate(zip(r["driver_calls_per_step"], r["driver_ms_per_step"], r["syncs_per_step"])):
        print(f"  step {k:2d}: {c:6d} driver calls  {m:7.1f} ms  {s:3d} syncs")
    if args.train_jsonl is None:
        return 0
    variant = args.snapshot.name.removeprefix("train-").split(".")[0]
    gpu = next((json.loads(x) for x in args.train_jsonl.read_text().splitlines()
                if json.loads(x).get("variant") == variant and json.loads(x).get("mode") == args.mode
                and "error" not in json.loads(x)), None)
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
