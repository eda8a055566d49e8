"""The real H200 snapshots shipped inside the package (see ``vmstoolkit/data/traces/README.md``)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

_DIR = resources.files("vmstoolkit.data") / "traces"


def bundled_trace_paths(mode: str = "caching") -> list[Path]:
    """Paths of the bundled snapshots recorded under ``mode`` (``caching`` or ``expandable``)."""
    return sorted(Path(str(p)) for p in _DIR.iterdir() if p.name.endswith(f".{mode}.pickle.gz"))


def recorded_stats(trace_path: str | Path, mode: str | None = None) -> dict | None:
    """What PyTorch itself reported for the run of a bundled trace (``NAME.MODE.json``), if any.

    ``mode`` picks the sibling run (``"expandable"`` for the caching trace's workload).
    """
    p = Path(trace_path)
    stem = p.name.split(".")[0]
    own_mode = p.name.split(".")[1] if p.name.count(".") >= 2 else "caching"
    j = p.with_name(f"{stem}.{mode or own_mode}.json")
    if not j.exists():
        return None
    return json.loads(j.read_text())
