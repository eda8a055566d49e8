"""The fragmentation experiment as pure functions: replay jobs, the paper-style table, savings,
CSV and JSON. Nothing here prints; the CLI (``vmstoolkit experiment fragmentation``) and
``experiments/fragmentation.py`` do.

A *trace spec* is a snapshot path or ``synthetic:KIND[:SEED]`` (see
:mod:`vmstoolkit.trace.synthetic`); rows of synthetic traces are marked ``synthetic`` and the
JSON carries :data:`~vmstoolkit.trace.synthetic.SYNTHETIC_NOTE`.
"""

from __future__ import annotations

import csv
import io
import json
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from vmstoolkit.trace.replay import ReplayResult
from vmstoolkit.trace.synthetic import KINDS, SYNTHETIC_NOTE, is_synthetic_spec, parse_synthetic_spec

GiB = 1 << 30
DEFAULT_ALLOCATORS = ("pytorch-caching", "pytorch-expandable", "gmlake", "vms")
OURS = "vms"


@dataclass(frozen=True)
class Job:
    spec: str
    allocator: str
    timeline: bool = False
    load: dict = field(default_factory=dict)
    """Keywords for loading the snapshot (``gpu``, ``lenient``, ``max_bytes``, ``max_objects``)."""


def default_specs(synthetic: bool = False) -> list[str]:
    """The bundled H200 traces (the caching runs: the allocation stream both runs share),
    plus one of every synthetic kind when ``synthetic``."""
    from vmstoolkit.trace.bundled import bundled_trace_paths

    specs = [str(p) for p in bundled_trace_paths("caching")]
    if synthetic:
        specs += [f"synthetic:{k}" for k in KINDS]
    return specs


def workload_name(trace_name: str) -> str:
    """``llama-full`` for ``llama-full.caching``; synthetic names stay."""
    for suffix in (".caching", ".expandable"):
        if trace_name.endswith(suffix):
            return trace_name[: -len(suffix)]
    return trace_name


def spec_workload(spec: str) -> str:
    if is_synthetic_spec(spec):
        kind, seed = parse_synthetic_spec(spec)
        return f"synthetic-{kind}-seed{seed}"
    from vmstoolkit.trace.loader import trace_name

    return workload_name(trace_name(spec))


def run_job(job: Job) -> ReplayResult:
    """Replay one (trace spec, allocator) on a fresh simulated driver. Runs in worker processes."""
    if is_synthetic_spec(job.spec):
        from vmstoolkit.pools import make_allocator, make_driver
        from vmstoolkit.trace.replay import replay
        from vmstoolkit.trace.synthetic import synthetic_trace

        kind, seed = parse_synthetic_spec(job.spec)
        trace = synthetic_trace(kind, seed)
        driver = make_driver("sim")
        alloc = make_allocator(job.allocator, driver)
        try:
            result = replay(trace, alloc, timeline=job.timeline)
        finally:
            alloc.close()
        result.extra["synthetic"] = True
        return result
    from vmstoolkit.trace.run import replay_one

    return replay_one(job.spec, job.allocator, timeline=job.timeline, **job.load)


def run_jobs(jobs: list[Job], n_workers: int = 1, on_done: Callable[[Job, ReplayResult], None] | None = None) -> list[ReplayResult]:
    """Run ``jobs`` (in ``n_workers`` processes when more than one); results in job order."""
    results: list[ReplayResult | None] = [None] * len(jobs)
    if n_workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            results[i] = run_job(job)
            if on_done:
                on_done(job, results[i])
        return results  # type: ignore[return-value]
    with ProcessPoolExecutor(max_workers=min(n_workers, len(jobs))) as pool:
        futures = {pool.submit(run_job, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_done:
                on_done(jobs[i], results[i])
    return results  # type: ignore[return-value]


def plan_jobs(specs: list[str], allocators: list[str], timeline_workload: str | None,
              load: dict | None = None) -> list[Job]:
    """Every (spec, allocator) job; timelines only for the chosen workload's trace; ``load``:
    keywords for loading each snapshot (see :class:`Job`)."""
    return [Job(s, a, timeline=spec_workload(s) == timeline_workload, load=dict(load or {}))
            for s in specs for a in allocators]


def recorded_reference(spec: str) -> dict:
    """What PyTorch itself reported for a bundled trace's workload (caching and expandable runs)."""
    if is_synthetic_spec(spec):
        return {}
    from vmstoolkit.trace.bundled import recorded_stats

    out = {}
    for mode in ("caching", "expandable"):
        stats = recorded_stats(spec, mode)
        if stats and "peak_reserved" in stats:
            out[f"recorded_{mode}_peak_reserved"] = int(stats["peak_reserved"])
    return out


def savings(baseline_reserved: int, ours_reserved: int) -> tuple[float, float]:
    """(GiB, % of the baseline) that ours saves against a baseline; negative: ours reserves more.

    >>> savings(30 * GiB, 27 * GiB)
    (3.0, 10.0)
    """
    saved = baseline_reserved - ours_reserved
    return saved / GiB, (100.0 * saved / baseline_reserved if baseline_reserved else 0.0)


def fragmentation_rows(specs: list[str], allocators: list[str], results: Iterable[ReplayResult]) -> list[dict]:
    """One row per workload: peak allocated, each allocator's peak reserved and utilization,
    and (when ``vms`` is among the allocators) what ``vms`` saves against each other one."""
    by_key = {}
    for r in results:
        by_key[(workload_name(r.trace), r.allocator)] = r
    rows = []
    for spec in specs:
        w = spec_workload(spec)
        row: dict = {"workload": w, "synthetic": is_synthetic_spec(spec)}
        rs = [by_key[(w, a)] for a in allocators if (w, a) in by_key]
        row["events"] = rs[0].events if rs else 0
        row["peak_allocated"] = max((r.peak_allocated for r in rs), default=0)
        for a in allocators:
            r = by_key.get((w, a))
            row[f"{a}.peak_reserved"] = r.peak_reserved if r else None
            row[f"{a}.utilization"] = round(r.utilization, 6) if r else None
            row[f"{a}.oom"] = r.oom if r else None
        if OURS in allocators and (w, OURS) in by_key:
            ours = by_key[(w, OURS)]
            for a in allocators:
                if a == OURS or (w, a) not in by_key:
                    continue
                gib, pct = savings(by_key[(w, a)].peak_reserved, ours.peak_reserved)
                row[f"vms_saved_vs_{a}.gib"] = round(gib, 4)
                row[f"vms_saved_vs_{a}.pct"] = round(pct, 3)
        row.update(recorded_reference(spec))
        rows.append(row)
    return rows


def rows_to_csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def markdown_table(rows: list[dict], allocators: list[str]) -> str:
    """The table as Markdown (sizes in GiB, utilization in %), synthetic rows starred."""
    baselines = [a for a in allocators if a != OURS] if OURS in allocators else []
    head = ["workload", "peak allocated"] + [f"{a} reserved (util)" for a in allocators] \
        + [f"vms saves vs {a}" for a in baselines]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"] + (" *" if r["synthetic"] else ""), f"{r['peak_allocated'] / GiB:.2f} GiB"]
        for a in allocators:
            res = r.get(f"{a}.peak_reserved")
            cells.append("-" if res is None else
                         f"{res / GiB:.2f} GiB ({100 * r[f'{a}.utilization']:.1f}%)" + (" OOM" if r.get(f"{a}.oom") else ""))
        for a in baselines:
            gib = r.get(f"vms_saved_vs_{a}.gib")
            cells.append("-" if gib is None else f"{gib:+.2f} GiB ({r[f'vms_saved_vs_{a}.pct']:+.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    if any(r["synthetic"] for r in rows):
        lines.append("")
        lines.append(f"\\* {SYNTHETIC_NOTE}")
    return "\n".join(lines) + "\n"


def experiment_json(rows: list[dict], results: list[ReplayResult], *, allocators: list[str], command: str = "",
                    machine: str = "") -> str:
    """The table, every replay's figures, and how they were made, as one JSON document."""
    doc = {
        "experiment": "fragmentation",
        "command": command,
        "machine": machine,
        "allocators": allocators,
        "savings": f"(baseline peak reserved - {OURS} peak reserved), in GiB and % of the baseline",
        "rows": rows,
        "replays": [r.as_dict() for r in results],
    }
    if any(r.get("synthetic") for r in rows):
        doc["synthetic_note"] = SYNTHETIC_NOTE
    return json.dumps(doc, indent=2, default=str) + "\n"


def write_outputs(out_dir: Path, rows: list[dict], results: list[ReplayResult], *, allocators: list[str],
                  timeline_workload: str | None, command: str = "", machine: str = "") -> list[Path]:
    """Write ``fragmentation.csv``, ``fragmentation.md``, ``fragmentation.json``, ``utilization.png`` and
    ``timeline-WORKLOAD.png`` under ``out_dir``; returns the paths written."""
    from vmstoolkit.analysis.figures import timeline_figure, utilization_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    p = out_dir / "fragmentation.csv"
    p.write_text(rows_to_csv(rows))
    written.append(p)
    p = out_dir / "fragmentation.md"
    p.write_text(markdown_table(rows, allocators))
    written.append(p)
    p = out_dir / "fragmentation.json"
    p.write_text(experiment_json(rows, results, allocators=allocators, command=command, machine=machine))
    written.append(p)
    p = out_dir / "utilization.png"
    utilization_figure(rows, allocators, p)
    written.append(p)
    timelines = {r.allocator: r.timeline for r in results
                 if r.timeline is not None and workload_name(r.trace) == timeline_workload}
    if timelines:
        synthetic = any(r["synthetic"] for r in rows if r["workload"] == timeline_workload)
        p = out_dir / f"timeline-{timeline_workload}.png"
        timeline_figure(timelines, timeline_workload, p, synthetic=synthetic)
        written.append(p)
    return written
