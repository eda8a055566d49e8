"""A sweep: every snapshot x allocator x combination of allocator options, as replay jobs.

``vmstoolkit sweep`` plans the jobs here, runs them with :mod:`vmstoolkit.analysis.runner`
(local processes or a Dask cluster) and prints :func:`sweep_rows`. Pure functions, no printing.

>>> expand_grid({"reuse_max_ratio": [1, 2], "stitched_prefix": [True, False]})
[{'reuse_max_ratio': 1, 'stitched_prefix': True}, {'reuse_max_ratio': 1, 'stitched_prefix': False}, {'reuse_max_ratio': 2, 'stitched_prefix': True}, {'reuse_max_ratio': 2, 'stitched_prefix': False}]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from vmstoolkit.errors import ConfigError

SNAPSHOT_SUFFIXES = (".pickle", ".pickle.gz", ".pkl", ".pkl.gz")


@dataclass(frozen=True)
class SweepJob:
    """One replay: ``trace`` (a snapshot path) through ``allocator`` built with ``options``
    (sorted ``(key, value)`` pairs, so jobs stay hashable and picklable) on a simulated device
    of ``capacity`` bytes (None: the driver's default); ``load``: how the snapshot is read
    (``(key, value)`` pairs of :func:`~vmstoolkit.trace.run.replay_one`'s ``gpu``, ``lenient``,
    ``max_bytes``, ``max_objects``)."""

    trace: str
    allocator: str
    options: tuple[tuple[str, object], ...] = ()
    capacity: int | None = None
    load: tuple[tuple[str, object], ...] = ()


def expand_grid(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's values (cartesian product, keys in the order given);
    ``[{}]`` for an empty grid."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def snapshot_paths(items: list[str | Path]) -> list[Path]:
    """Files as given; a folder stands for the snapshots directly in it (sorted by name)."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(SNAPSHOT_SUFFIXES))
        else:
            out.append(p)
    return out


def plan_sweep(traces: list[str | Path], allocators: list[str], grid: dict[str, list],
               capacity: int | None = None, *, fixed: dict[str, dict] | None = None,
               load: dict | None = None) -> list[SweepJob]:
    """Jobs in the order trace, allocator, grid combination; ``fixed[allocator]``: options every
    one of that allocator's jobs takes besides the grid's (a key may not be in both)."""
    combos = expand_grid(grid)
    fixed = fixed or {}
    for a in allocators:
        both = sorted(set(fixed.get(a, {})) & set(grid))
        if both:
            raise ConfigError(f"{a}: option {both[0]} is given both as -o and as --grid; give it once")
    loading = tuple(sorted((k, v) for k, v in (load or {}).items() if v is not None and v is not False))
    return [SweepJob(str(t), a, tuple(sorted({**fixed.get(a, {}), **c}.items())), capacity, loading)
            for t in traces for a in allocators for c in combos]


def run_sweep_job(job: SweepJob) -> dict:
    """Replay one job on a fresh simulated driver; its figures as a flat row. Runs in workers."""
    from vmstoolkit.trace.run import replay_one

    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY

    r = replay_one(job.trace, job.allocator, capacity=job.capacity, options=dict(job.options), **dict(job.load))
    return {
        "trace": r.trace,
        "source": job.trace,
        "allocator": r.allocator,
        "options": ",".join(f"{k}={v}" for k, v in job.options),
        **{f"option.{k}": v for k, v in job.options},
        "events": r.events,
        "peak_allocated": r.peak_allocated,
        "peak_reserved": r.peak_reserved,
        "utilization": round(r.utilization, 6),
        "oom": r.oom,
        "driver_calls": sum(r.driver_calls.values()),
        "capacity": job.capacity or DEFAULT_CAPACITY,
        "seconds": round(r.seconds, 4),
    }


def sweep_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with ``vs_best``: peak reserved over the lowest peak reserved of the same trace
    among the runs that did not run out of memory (1.0 marks the best)."""
    best: dict[str, int] = {}
    for r in rows:
        if not r["oom"]:
            best[r["trace"]] = min(best.get(r["trace"], r["peak_reserved"]), r["peak_reserved"])
    return [{**r, "vs_best": round(r["peak_reserved"] / best[r["trace"]], 4) if r["trace"] in best and not r["oom"]
             else None} for r in rows]
