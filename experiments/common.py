"""What the scripts in ``experiments/`` share; they import this module and ``vmstoolkit``, never
each other. ``python experiments/X.py`` puts this folder on ``sys.path``, so ``import common``
needs nothing more. Nothing here imports torch at import time.

- Sweeps over traces: :func:`sweep` runs every (trace, row), :func:`grid` tables the results,
  :func:`write` saves them (JSON with the command, and Markdown).
- The driver cost model: :data:`COST_US` and :class:`DriverMeter` price the simulated driver's
  calls with the H200's measured per-call costs; :func:`replay_passes` replays a trace several
  times in a row through an allocator and prices each pass.
- Training modes: :func:`split_modes` and :func:`allocator_mode` read ``--modes`` lists whose
  items are PyTorch's modes (``default``, ``expandable``, ...) or vmstoolkit allocators in the
  library's one syntax (``paged:aliases=true,slack_pages=64``:
  :func:`vmstoolkit.pools.registry.parse_allocator_spec`); :func:`train_shapes` is the training
  scripts' plan of batch and sequence length per step.
- Training histories: :func:`replay_steps` replays one step by step through ``paged`` (its
  Python allocator or the compiled hook PyTorch runs).
- GPU timing: :func:`say`, :func:`run_env`, :func:`tf32_off`, :func:`time_events`, :func:`time_best`
  (events around back-to-back calls) and :func:`time_held` (the same behind a GPU spin: the GPU's
  time alone).
"""

from __future__ import annotations

import json
import platform
import random
import sys
from pathlib import Path
from typing import Callable

from vmstoolkit.errors import ConfigError, VmsError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers import make_driver
from vmstoolkit.pools.registry import AllocatorSpec, parse_allocator_spec
from vmstoolkit.trace import bundled_trace_paths, load_trace

# -- sweeps over traces ----------------------------------------------------------------------------


def sweep(labels, run: Callable[[object, str], dict], key: str, describe: Callable[[dict], str],
          traces: list[Path] | None = None) -> list[dict]:
    """``run(trace, label)`` for every trace (the bundled ones by default) and label; each result
    gets ``trace`` and ``key: label`` and is printed with ``describe``."""
    rows = []
    for path in traces or bundled_trace_paths():
        trace = load_trace(path)
        for label in labels:
            row = {"trace": trace.name.split(".")[0], key: label, **run(trace, label)}
            rows.append(row)
            print(f"{row['trace']:14s} {label:34s} {describe(row)}", flush=True)
    return rows


def grid(rows: list[dict], key: str, cell: Callable[[dict], str], corner: str) -> str:
    """A Markdown table: one line per ``key`` value, one column per trace."""
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    labels = list(dict.fromkeys(r[key] for r in rows))
    by = {(r["trace"], r[key]): r for r in rows}
    lines = [f"| {corner} | " + " | ".join(traces) + " |", "|---|" + "---|" * len(traces)]
    for lab in labels:
        lines.append(f"| {lab} | " + " | ".join(cell(by[(t, lab)]) for t in traces) + " |")
    return "\n".join(lines)


def write(out: Path | None, stem: str, rows: list[dict], table: str) -> None:
    """``out/stem.json`` (the command and every row) and ``out/stem.md`` (the table)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")


# -- the driver cost model -------------------------------------------------------------------------

COST_US = {"create": 16.0, "map": 2.9, "unmap": 3.0, "release": 5.0, "reserve": 5.0, "free_address": 5.0}
"""Microseconds per driver call, measured on the H200 by ``experiments/gpu_pools.py``
(``results/h200/gpu_pools.json``: cuMemCreate 16 us, cuMemMap 2.9 us, cuMemUnmap ~3 us, address
reserve/free ~5 us). A model, not a measurement of the runs it prices: it says where driver
time goes."""
SET_ACCESS_US_PER_CHUNK = 25.0
"""cuMemSetAccess costs about 25 us per 2 MiB chunk of a new mapping on the H200 (same file)."""
WARM_PASSES = 2
"""Passes of a repeated replay that warm the pools up; steady state is the passes after them."""


class DriverMeter:
    """The work a driver did since a :meth:`mark`, priced with :data:`COST_US`. Counts the chunks
    given access rights by wrapping this driver object's ``set_access`` (attach it before anything
    captures that method)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.chunks = 0
        inner = driver.set_access

        def counted(va: int, size: int) -> None:
            self.chunks += size // driver.granularity
            inner(va, size)

        driver.set_access = counted

    def mark(self) -> tuple[dict, int, int]:
        return dict(self.driver.calls), self.chunks, self.driver.syncs

    def since(self, mark: tuple[dict, int, int]) -> dict:
        """``calls`` (per driver call, since ``mark``), ``us`` (their modelled microseconds) and ``syncs``."""
        calls0, chunks0, syncs0 = mark
        calls = {k: v - calls0.get(k, 0) for k, v in self.driver.calls.items()}
        us = sum(COST_US.get(k, 0.0) * v for k, v in calls.items()) + SET_ACCESS_US_PER_CHUNK * (self.chunks - chunks0)
        return {"calls": calls, "us": us, "syncs": self.driver.syncs - syncs0}


def replay_passes(trace, make: Callable, passes: int, *, counters: Callable[[object], dict] | None = None,
                  end_pass: Callable[[object], None] | None = None) -> dict:
    """Replay ``trace`` ``passes`` times in a row through ``make(driver)`` on a fresh simulated
    driver, as a training run meets the same shapes again. Allocations still live at the end of
    a pass are freed, then ``end_pass(target)`` runs (if given).

    Returns ``peak_reserved`` and ``utilization`` (the target's ``stats()``), ``events_per_pass``
    and ``per_pass``: per pass, ``requests`` (allocations and frees served), ``calls``, ``us`` and
    ``syncs`` (:meth:`DriverMeter.since`) and ``counters``: how much each of ``counters(target)``
    grew. Steady state is the passes after the first :data:`WARM_PASSES` (:func:`steady`)."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    driver = make_driver("sim")
    meter = DriverMeter(driver)
    target = make(driver)
    events = trace.alloc_free_events()
    count = counters or (lambda _: {})
    per_pass = []
    for _ in range(passes):
        mark, before = meter.mark(), dict(count(target))
        live: dict[int, int] = {}
        requests = 0
        for e in events:
            if e.action.value == "alloc":
                live[e.addr] = target.allocate(e.size, e.stream)
                requests += 1
            else:
                ptr = live.pop(e.addr, None)
                if ptr is not None:
                    target.free(ptr)
                    requests += 1
        for ptr in live.values():
            target.free(ptr)
            requests += 1
        if end_pass is not None:
            end_pass(target)
        grew = {k: v - before.get(k, 0) for k, v in count(target).items()}
        per_pass.append({"requests": requests, **meter.since(mark), "counters": grew})
    s = target.stats()
    target.close()
    return {"peak_reserved": s.peak_reserved_bytes, "utilization": s.utilization, "events_per_pass": len(events),
            "per_pass": per_pass}


def steady(per_pass: list[dict]) -> list[dict]:
    """The passes after the first :data:`WARM_PASSES` (the last pass when there are no more)."""
    return per_pass[min(WARM_PASSES, len(per_pass) - 1):]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def priced(r: dict, **per_pass_extra: Callable[[dict], float]) -> dict:
    """A row from :func:`replay_passes`' result: ``peak_reserved``, ``utilization``, the steady
    means ``steady_driver_ms`` and ``steady_syncs``, and ``per_pass`` (``driver_ms``, ``syncs``
    and, per keyword, ``name: f(pass)``; each of those is averaged over steady state too)."""
    per_pass = [{"driver_ms": p["us"] / 1000, "syncs": p["syncs"], **{k: f(p) for k, f in per_pass_extra.items()}}
                for p in r["per_pass"]]
    warm = steady(per_pass)
    return {"peak_reserved": r["peak_reserved"], "utilization": r["utilization"],
            "steady_driver_ms": mean(p["driver_ms"] for p in warm),
            **{k: mean(p[k] for p in warm) for k in per_pass_extra},
            "steady_syncs": mean(p["syncs"] for p in warm), "per_pass": per_pass}


# -- training modes and plans ------------------------------------------------------------------------

PYTORCH_MODES = ("default", "expandable", "async", "hook-async", "hook-async-gil")
"""``train_llama_gpu.py``'s modes that are PyTorch's own allocator (its default, expandable
segments, the driver's async pool, that pool behind the hook); every other mode names a
vmstoolkit allocator."""


def split_modes(text: str) -> list[str]:
    """``"default,expandable,paged:aliases=true,slack_pages=64"`` -> ``["default", "expandable",
    "paged:aliases=true,slack_pages=64"]``: a comma starts a new mode unless what follows it
    continues the mode before (``KEY=VALUE`` with no allocator before it, or a value's own
    ``x:y``). The old ``+`` between options stays inside its mode."""
    modes: list[str] = []
    for piece in text.split(","):
        eq, colon = piece.find("="), piece.find(":")
        continues = (eq >= 0 and (colon < 0 or eq < colon)) or (eq < 0 and colon >= 0)
        if modes and continues:
            modes[-1] += "," + piece
        elif piece:
            modes.append(piece)
    return modes


def allocator_mode(mode: str, others: tuple[str, ...] = PYTORCH_MODES) -> AllocatorSpec | None:
    """The vmstoolkit allocator and options of a training mode, or ``None`` for one of ``others``
    (PyTorch's own modes, which the script handles). Raises
    :class:`~vmstoolkit.errors.ConfigError` naming the mode otherwise."""
    return None if mode in others else parse_allocator_spec(mode)


def same_mode(a: str, b: str, others: tuple[str, ...] = PYTORCH_MODES) -> bool:
    """Whether two spellings name the same mode (``paged:aliases=True+slack_pages=64`` is
    ``paged:aliases=true,slack_pages=64``); a mode that is not one of ``others`` and names no
    allocator is only itself."""
    if a == b:
        return True
    if a in others or b in others:
        return False
    try:
        return parse_allocator_spec(a) == parse_allocator_spec(b)
    except ConfigError:
        return False


def train_shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """``train_llama_gpu.py``'s plan: (batch, sequence length) of each of ``n`` steps, batch
    from {4, 6, 8} and length from 256 to 2048 in steps of 128, seeded."""
    rng = random.Random(seed)
    return [(rng.choice([4, 6, 8]), rng.choice(range(256, 2049, 128))) for _ in range(n)]


# -- training histories, step by step ---------------------------------------------------------------


def step_starts(events, plan: list[tuple[int, int]], rounds: int) -> list[int]:
    """Index of each step's first event: the allocation of its input ids, in the plan's order."""
    sizes = [b * s * 8 for b, s in plan] * rounds
    starts, j = [], 0
    for i, e in enumerate(events):
        if j < len(sizes) and e.action.value == "alloc" and e.size == sizes[j]:
            starts.append(i)
            j += 1
    if j < len(sizes):
        raise VmsError(f"found {j} of {len(sizes)} steps' input ids: not a run of {rounds} rounds of the "
                       f"{len(plan)} steps {plan}")
    return starts


def replay_steps(trace, options: dict, plan: list[tuple[int, int]], rounds: int = 3, native: bool = False) -> dict:
    """Replay a training history through ``paged`` with ``options`` on the simulated driver, step
    by step (steps found by :func:`step_starts`): per step the driver calls, their modelled
    milliseconds (:class:`DriverMeter`) and the synchronizations; and the peak reserved.
    ``native``: through the compiled hook that runs inside PyTorch, not the Python allocator."""
    events = trace.alloc_free_events()
    starts = step_starts(events, plan, rounds)
    driver = make_driver("sim")
    meter = DriverMeter(driver)
    if native:
        from vmstoolkit.integrations.hook_allocator import HookAllocator

        alloc = HookAllocator("paged", driver, **options)
    else:
        alloc = make_allocator("paged", driver, **options)
    bounds = starts[1:] + [len(events)]
    live: dict[int, int] = {}
    calls, ms, syncs = [], [], []
    i = 0
    try:
        for end in bounds:  # the events before the first step's ids (model and optimizer) count in step 1
            mark = meter.mark()
            for e in events[i:end]:
                if e.action.value == "alloc":
                    live[e.addr] = alloc.allocate(e.size, e.stream)
                elif e.addr in live:
                    alloc.free(live.pop(e.addr))
            i = end
            step = meter.since(mark)
            calls.append(sum(step["calls"].values()))
            ms.append(step["us"] / 1000)
            syncs.append(step["syncs"])
        peak = alloc.stats().peak_reserved_bytes
    finally:
        alloc.close()
    return {"driver_calls_per_step": calls, "driver_ms_per_step": ms, "syncs_per_step": syncs, "peak_reserved": peak}


# -- GPU timing --------------------------------------------------------------------------------------------


def say(*a) -> None:
    print(*a, flush=True)


def run_env(**extra) -> dict:
    """What a GPU benchmark ran on and how it was called, for its JSON (``extra``: more versions)."""
    import numba
    import numpy as np
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "numba": numba.__version__,
            "numpy": np.__version__, "python": platform.python_version(),
            "tf32": torch.backends.cuda.matmul.allow_tf32, **extra, "command": " ".join(sys.argv)}


def tf32_off() -> None:
    """fp32 matrix products in fp32 (cuBLAS, the reference, may otherwise use TF32)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _events(kind: str):
    """(synchronize, pair) for CUDA-event timing: ``pair()`` makes two events and a function
    giving the milliseconds between them. ``kind``: ``"torch"`` or ``"numba"``."""
    if kind == "torch":
        import torch

        def pair():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            return e0, e1, lambda: e0.elapsed_time(e1)
        return torch.cuda.synchronize, pair
    from numba import cuda

    def pair():
        e0, e1 = cuda.event(), cuda.event()
        return e0, e1, lambda: cuda.event_elapsed_time(e0, e1)
    return cuda.synchronize, pair


def time_events(fn: Callable[[], object], iters: int, warmup: int = 2, *, per_event: int = 1,
                events: str = "torch") -> float:
    """Median milliseconds per call of ``fn()`` (enqueued on the default stream), timed by CUDA
    events around ``per_event`` calls at a time, ``iters`` times, after ``warmup`` calls.
    ``events``: ``"torch"`` (``torch.cuda.Event``) or ``"numba"`` (``numba.cuda.event``)."""
    return time_best(fn, per_event, iters, warmup, events=events)[1]


def time_best(fn: Callable[[], object], reps: int, samples: int = 5, warmup: int = 1, *,
              events: str = "numba") -> tuple[float, float]:
    """(best, median) milliseconds per call of ``fn()``: CUDA events around ``reps`` back-to-back
    calls (a Numba launch's host cost then overlaps the kernels instead of being timed, all but
    the first call's), ``samples`` such batches after ``warmup`` calls. ``events``: ``"numba"`` or
    ``"torch"``. :func:`time_held` times the GPU's work alone."""
    import numpy as np

    sync, pair = _events(events)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(samples):
        e0, e1, elapsed = pair()
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        times.append(elapsed() / reps)
    return float(np.min(times)), float(np.median(times))


HOLD_MS = 1.0  # time_held's first hold of the stream; doubled while too short


def time_held(fn: Callable[[], object], reps: int, samples: int = 5, warmup: int = 1) -> dict:
    """The GPU time of ``fn()`` alone: as :func:`time_best`, but each batch is enqueued behind a
    GPU spin (``torch.cuda._sleep``; NVBench's "blocking kernel" does the same), so that all
    ``reps`` calls are queued before the first event is reached and no call's host cost is timed.
    A batch whose calls took the host longer than the spin held the GPU is taken again behind a
    spin twice as long. ``fn`` must enqueue on the default stream (torch's current stream and
    Numba's stream 0 are both it). Returns ``best_ms`` and ``median_ms`` per call, ``host_ms``
    (median host time per call: what the GPU waits for when nothing is queued) and ``hold_ms``."""
    import time

    import numpy as np
    import torch

    def event():
        return torch.cuda.Event(enable_timing=True)

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    h0, h1 = event(), event()  # the spin's cycles per millisecond on this GPU
    h0.record()
    torch.cuda._sleep(1_000_000)
    h1.record()
    h1.synchronize()
    cycles_per_ms = 1_000_000 / h0.elapsed_time(h1)
    hold, times, host = HOLD_MS, [], []
    while len(times) < samples:
        h0, e0, e1 = event(), event(), event()
        t0 = time.perf_counter()
        h0.record()
        torch.cuda._sleep(int(hold * cycles_per_ms))
        e0.record()
        for _ in range(reps):
            fn()
        t_host = (time.perf_counter() - t0) * 1e3
        e1.record()
        e1.synchronize()
        if t_host >= h0.elapsed_time(e0):  # the GPU reached e0 before every call was queued
            if hold > 1000:
                raise RuntimeError(f"time_held: {reps} calls took the host {t_host:.1f} ms, longer than any hold")
            hold *= 2
            continue
        times.append(e0.elapsed_time(e1) / reps)
        host.append(t_host / reps)
    return {"best_ms": float(np.min(times)), "median_ms": float(np.median(times)),
            "host_ms": float(np.median(host)), "hold_ms": hold}
