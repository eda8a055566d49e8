"""The fragmentation experiment as pure functions: replay jobs, the paper-style table, savings,
CSV and JSON. Nothing here prints; the CLI (``vmstoolkit experiment fragmentation``) and
``experiments/fragmentation.py`` do.

A *trace spec* is a snapshot path or ``synthetic:KIND[:SEED]`` (see
:mod:`vmstoolkit.trace.synthetic`); rows of synthetic traces are marked ``synthetic`` and the
JSON carries :data:`~vmstoolkit.trace.synthetic.SYNTHETIC_NOTE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from vmstoolkit.analysis.rows import file_sha256, replay_row, rows_to_csv, uniform
from vmstoolkit.pools.options import format_options
from vmstoolkit.trace.replay import ReplayResult
from vmstoolkit.trace.synthetic import KINDS, SYNTHETIC_NOTE, is_synthetic_spec, parse_synthetic_spec
from vmstoolkit.units import GiB

DEFAULT_ALLOCATORS = ("pytorch-caching", "pytorch-expandable", "gmlake", "vms")
OURS = "vms"


@dataclass(frozen=True)
class Job:
    """One replay: a trace spec through an allocator with its options (a tuple of ``(key, value)``,
    hashable) on a simulated device of ``capacity`` bytes (``None``: the default)."""

    spec: str
    allocator: str
    timeline: bool = False
    options: tuple = ()
    capacity: int | None = None
    load: tuple = ()
    """Keywords for loading the snapshot as ``(key, value)`` pairs (``gpu``, ``lenient``,
    ``max_bytes``, ``max_objects``)."""


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
    """Replay one (trace spec, allocator) on a fresh simulated driver
    (:func:`vmstoolkit.trace.run.replay_trace`, the one job assembly). Runs in worker processes."""
    from vmstoolkit.trace.run import replay_one, replay_trace

    if is_synthetic_spec(job.spec):
        from vmstoolkit.trace.synthetic import synthetic_trace

        result = replay_trace(synthetic_trace(*parse_synthetic_spec(job.spec)), job.allocator, capacity=job.capacity,
                              timeline=job.timeline, options=dict(job.options))
        result.extra["synthetic"] = True
        return result

    if not Path(job.spec).is_file():  # checked by the CLI, but a cluster's worker may be elsewhere
        import platform

        from vmstoolkit.errors import TraceFormatError

        raise TraceFormatError(f"no trace file {job.spec} on worker host {platform.node()!r}: the workers of a "
                               f"cluster need the snapshots at the same path (a shared filesystem)")
    return replay_one(job.spec, job.allocator, timeline=job.timeline, options=dict(job.options),
                      capacity=job.capacity, **dict(job.load))


def run_jobs(jobs: list[Job], n_workers: int = 1, on_done: Callable[[Job, ReplayResult], None] | None = None,
             *, cluster: str | None = None) -> list[ReplayResult]:
    """Run ``jobs`` (in ``n_workers`` local processes when more than one, or on the Dask
    cluster ``cluster``: ``local:N`` or a scheduler address); results in job order, identical
    wherever they ran (:func:`vmstoolkit.analysis.runner.run_jobs`)."""
    from vmstoolkit.analysis.runner import run_jobs as run

    return run(run_job, jobs, n_workers, cluster=cluster, on_done=on_done)


def plan_jobs(specs: list[str], allocators: list[str], timeline_workload: str | None, *,
              options: dict[str, dict] | None = None, capacity: int | None = None,
              load: dict | None = None) -> list[Job]:
    """Every (spec, allocator) job, with each allocator's ``options``; timelines only for the
    chosen workload's trace (``None``: every workload's); ``load``: keywords for loading each
    snapshot (see :class:`Job`)."""
    options = options or {}
    return [Job(s, a, timeline=timeline_workload is None or spec_workload(s) == timeline_workload,
                options=tuple(options.get(a, {}).items()), capacity=capacity, load=tuple((load or {}).items()))
            for s in specs for a in allocators]


def savings_pairs(allocators: list[str], baseline: str | None = None) -> list[tuple[str, str]]:
    """The (allocator, baseline) pairs of the savings columns: with ``baseline``, what every other
    allocator saves against it; without, what ``vms`` saves against every other one (the
    published table), when ``vms`` ran.

    >>> savings_pairs(["pytorch-caching", "paged", "vms"], "pytorch-caching")
    [('paged', 'pytorch-caching'), ('vms', 'pytorch-caching')]
    >>> savings_pairs(["pytorch-caching", "vms"])
    [('vms', 'pytorch-caching')]
    """
    if baseline is not None:
        return [(a, baseline) for a in allocators if a != baseline]
    return [(OURS, a) for a in allocators if a != OURS] if OURS in allocators else []


def spec_source(spec: str) -> tuple[str, str | None]:
    """(source, SHA-256 of the file) of a trace spec; a synthetic spec has no file."""
    if is_synthetic_spec(spec) or not Path(spec).is_file():
        return str(spec), None
    return str(spec), file_sha256(spec)


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


def fragmentation_rows(specs: list[str], allocators: list[str], results: Iterable[ReplayResult], *,
                       baseline: str | None = None, options: dict[str, dict] | None = None,
                       capacity: int | None = None) -> list[dict]:
    """One flat row per workload: what was replayed (source, its SHA-256, device, capacity, the
    toolkit's version), each allocator's options, peak reserved, utilization and out-of-memory
    event, and the savings of :func:`savings_pairs` (``None`` where either side ran out of memory)."""
    from vmstoolkit._version import __version__
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY

    options = options or {}
    by_key = {}
    for r in results:
        by_key[(workload_name(r.trace), r.allocator)] = r
    rows = []
    for spec in specs:
        w = spec_workload(spec)
        source, digest = spec_source(spec)
        row: dict = {"workload": w, "synthetic": is_synthetic_spec(spec), "source": source, "source_sha256": digest}
        rs = [by_key[(w, a)] for a in allocators if (w, a) in by_key]
        row["device"] = rs[0].as_dict().get("device") if rs else None
        row["capacity"] = capacity or DEFAULT_CAPACITY
        row["vmstoolkit"] = __version__
        row["events"] = max((r.events for r in rs), default=0)
        row["peak_allocated"] = max((r.peak_allocated for r in rs), default=0)
        for a in allocators:
            r = by_key.get((w, a))
            row[f"{a}.options"] = format_options(options.get(a, {}))
            row[f"{a}.peak_reserved"] = r.peak_reserved if r else None
            row[f"{a}.utilization"] = round(r.utilization, 6) if r else None
            row[f"{a}.oom"] = r.oom if r else None
            row[f"{a}.oom_event"] = r.oom_event if r else None
        for a, b in savings_pairs(allocators, baseline):
            ra, rb = by_key.get((w, a)), by_key.get((w, b))
            ok = ra is not None and rb is not None and not ra.oom and not rb.oom
            gib, pct = savings(rb.peak_reserved, ra.peak_reserved) if ok else (None, None)
            row[f"{a}_saved_vs_{b}.gib"] = round(gib, 4) if ok else None
            row[f"{a}_saved_vs_{b}.pct"] = round(pct, 3) if ok else None
        row.update(recorded_reference(spec))
        rows.append(row)
    return rows


def replay_rows(results: list[ReplayResult], jobs: list[Job]) -> list[dict]:
    """Every replay's flat row (:func:`vmstoolkit.analysis.rows.replay_row`), jobs in the same order,
    all with the same columns."""
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY

    sources = {s: spec_source(s) for s in dict.fromkeys(j.spec for j in jobs)}
    return uniform([replay_row(r, source=sources[j.spec][0], source_sha256=sources[j.spec][1],
                               capacity=j.capacity or DEFAULT_CAPACITY, options=dict(j.options))
                    for r, j in zip(results, jobs)])


def table_cells(rows: list[dict], allocators: list[str], baseline: str | None = None) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells as text (sizes in GiB, utilization in %, synthetic workloads
    starred, a replay that ran out of memory as ``OOM at event N``), shared by the terminal and
    Markdown tables."""
    pairs = savings_pairs(allocators, baseline)
    head = ["workload", "peak allocated"] + [f"{a} reserved (util)" for a in allocators] \
        + [f"{a} saves vs {b}" for a, b in pairs]
    body = []
    for r in rows:
        cells = [r["workload"] + (" *" if r["synthetic"] else ""), f"{r['peak_allocated'] / GiB:.2f} GiB"]
        for a in allocators:
            res = r.get(f"{a}.peak_reserved")
            if res is None:
                cells.append("-")
            elif r.get(f"{a}.oom"):
                cells.append(f"OOM at event {r[f'{a}.oom_event']}")
            else:
                cells.append(f"{res / GiB:.2f} GiB ({100 * r[f'{a}.utilization']:.1f}%)")
        for a, b in pairs:
            gib = r.get(f"{a}_saved_vs_{b}.gib")
            cells.append("-" if gib is None else f"{gib:+.2f} GiB ({r[f'{a}_saved_vs_{b}.pct']:+.1f}%)")
        body.append(cells)
    return head, body


def markdown_table(rows: list[dict], allocators: list[str], baseline: str | None = None) -> str:
    """The table as Markdown, synthetic rows starred (:func:`table_cells`)."""
    head, body = table_cells(rows, allocators, baseline)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    if any(r["synthetic"] for r in rows):
        lines.append("")
        lines.append(f"\\* {SYNTHETIC_NOTE}")
    return "\n".join(lines) + "\n"


def experiment_json(rows: list[dict], replays: list, *, allocators: list[str], baseline: str | None = None,
                    command: str = "", machine: str = "") -> str:
    """The table, every replay's flat row, and how they were made, as one JSON document."""
    pairs = savings_pairs(allocators, baseline)
    doc = {
        "experiment": "fragmentation",
        "command": command,
        "machine": machine,
        "allocators": allocators,
        "baseline": baseline,
        "savings": "A_saved_vs_B: (B's peak reserved - A's peak reserved), in GiB and % of B's; pairs: "
                   + (", ".join(f"{a} vs {b}" for a, b in pairs) or "none"),
        "rows": rows,
        "replays": [r.as_dict() if isinstance(r, ReplayResult) else r for r in replays],
    }
    if any(r.get("synthetic") for r in rows):
        doc["synthetic_note"] = SYNTHETIC_NOTE
    return json.dumps(doc, indent=2, default=str) + "\n"


def write_outputs(out_dir: Path, rows: list[dict], results: list[ReplayResult], *, allocators: list[str],
                  timeline_workload: str | None, command: str = "", machine: str = "", baseline: str | None = None,
                  replays: list[dict] | None = None) -> list[Path]:
    """Write ``fragmentation.csv``, ``fragmentation.md``, ``fragmentation.json``, ``utilization.png`` and
    the timeline (``timeline.png``: every workload; ``timeline-WORKLOAD.png`` for one) under
    ``out_dir``; returns the paths written."""
    from vmstoolkit.analysis.figures import timeline_figure, utilization_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    p = out_dir / "fragmentation.csv"
    p.write_text(rows_to_csv(rows))
    written.append(p)
    p = out_dir / "fragmentation.md"
    p.write_text(markdown_table(rows, allocators, baseline))
    written.append(p)
    p = out_dir / "fragmentation.json"
    p.write_text(experiment_json(rows, replays if replays is not None else results,
                                 allocators=allocators, baseline=baseline, command=command, machine=machine))
    written.append(p)
    p = out_dir / "utilization.png"
    utilization_figure(rows, allocators, p)
    written.append(p)
    timelines: dict[str, dict[str, dict]] = {}
    for r in results:
        w = workload_name(r.trace)
        if r.timeline is not None and (timeline_workload is None or w == timeline_workload):
            timelines.setdefault(w, {})[r.allocator] = r.timeline
    if timelines:
        synthetic = {r["workload"] for r in rows if r["synthetic"]}
        p = out_dir / ("timeline.png" if timeline_workload is None else f"timeline-{timeline_workload}.png")
        timeline_figure(timelines, p, synthetic=synthetic)
        written.append(p)
    return written
