"""Pooling the step times of several training calls: a step-time claim no single call can carry.

A host-bound step moves by +-10% from one process to the next, so one call's few processes decide
a 5% question badly. Each call (a JSON-lines file, one row per process, its modes interleaved)
gives the steady-state steps of each process of a mode (``load``); :func:`pooled` pools them over
the calls and resamples whole processes (a process, not a step, is the unit that varies) for a
95% interval of the ratio of pooled medians. ``experiments/pool_runs.py`` is its command line.

    >>> pooled([{"default": [[1.0, 1.0]], "paged": [[1.1, 1.1]]}], "default", "paged", resamples=10)["ratio"]
    1.1
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from vmstoolkit.errors import VmsError


def load(path: Path, variant: str, modes: tuple[str, ...], steps_per_round: int,
         model: str | None = None) -> dict[str, list[list[float]]]:
    """``{mode: [steady steps of each process]}`` of one call (failed processes left out); with
    ``model``, only that model's rows (a row that names none is ``"llama"``'s)."""
    out: dict[str, list[list[float]]] = {m: [] for m in modes}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if (r.get("variant") == variant and r.get("mode") in out and "error" not in r
                and (model is None or r.get("model", "llama") == model)):
            steady = r["step_times"][steps_per_round:]
            out[r["mode"]].append(steady or r["step_times"])
    return out


def ratio(base: list[list[float]], mode: list[list[float]]) -> float:
    return statistics.median(t for p in mode for t in p) / statistics.median(t for p in base for t in p)


def pooled(calls: list[dict[str, list[list[float]]]], base: str, mode: str, resamples: int = 10000,
           seed: int = 0) -> dict:
    """The pooled ratio over ``calls`` and its 95% interval (processes resampled within each call)."""
    use = [c for c in calls if c[base] and c[mode]]
    if not use:
        raise VmsError(f"no call ran both {base!r} and {mode!r}")
    all_base = [p for c in use for p in c[base]]
    all_mode = [p for c in use for p in c[mode]]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        b, m = [], []
        for c in use:
            b += [c[base][i] for i in rng.integers(0, len(c[base]), len(c[base]))]
            m += [c[mode][i] for i in rng.integers(0, len(c[mode]), len(c[mode]))]
        draws.append(ratio(b, m))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"calls": len(use), "processes": {base: len(all_base), mode: len(all_mode)},
            "ratio": ratio(all_base, all_mode), "interval_95": [float(lo), float(hi)],
            "per_call": [ratio(c[base], c[mode]) for c in use]}
