"""What the trace sweeps in ``experiments/`` share: every bundled trace times every row, printed
as it goes, then written as JSON (every field) and a Markdown grid (rows by trace)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from vmstoolkit.trace import bundled_trace_paths, load_trace


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
