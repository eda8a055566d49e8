"""Flat, self-describing result rows: one dict per replay, the same fields in table, JSON and CSV.

A row says what was replayed (the trace, its source file and that file's SHA-256, the device),
how (the allocator, its options, the capacity, the toolkit's version) and what came out (peaks,
utilization, the out-of-memory event when there was one). Nested counts become dotted columns
(``driver_calls.create``, ``paths.small``), so a CSV has one value per cell and the columns of
every row; :func:`rows_to_csv` writes the union of the rows' columns.

>>> flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}})
{'a': 1, 'b.c': 2, 'b.d.e': 3}
>>> print(rows_to_csv([{"x": 1}, {"x": 2, "y.z": 3}]), end="")
x,y.z
1,
2,3
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Iterable

from vmstoolkit._version import __version__
from vmstoolkit.pools.options import format_options

ROW_KEYS = ("trace", "source", "source_sha256", "device", "allocator", "options", "capacity", "vmstoolkit",
            "events", "peak_allocated", "peak_reserved", "utilization", "fragmentation", "oom", "oom_event",
            "oom_message", "unmatched_frees", "seconds", "events_per_second")
"""The leading columns of every replay row, in order; counts (``driver_calls.*``, ``paths.*``) and
anything else a replay reports follow, flattened."""

_HASH_BLOCK = 1 << 20  # read files in 1 MiB blocks: hashing streams at disk speed in constant memory


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as dotted keys, in order (lists and other values stay as they are)."""
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (as stored: of the gzip file for ``.gz``). Cost: one read.
    Anything but a regular file (``/dev/zero``, a FIFO) is the loader's one-line error, before
    a single byte is read; a file whose read fails (``/proc/self/mem``) is that error in one line."""
    from vmstoolkit.errors import TraceFormatError
    from vmstoolkit.trace.source import regular_file

    regular_file(Path(path))
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
    except OSError as e:
        raise TraceFormatError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    return h.hexdigest()


def replay_row(result, *, source: str = "", source_sha256: str | None = None, capacity: int | None = None,
               options: dict | None = None) -> dict:
    """The flat row of one :class:`~vmstoolkit.trace.replay.ReplayResult`.

    ``source``: the snapshot path (or a synthetic spec); ``capacity``: the device memory the
    replay ran against, in bytes (``None``: a real device's own); ``options``: the allocator's
    options as given (defaults are the toolkit version's). ``device`` is the recorded device the
    trace came from, when the result says. A real driver's device name is ``device_name``.
    """
    d = result.as_dict()
    extra = dict(d.pop("extra", None) or {})
    row: dict[str, Any] = {
        "trace": d.pop("trace"),
        "source": source,
        "source_sha256": source_sha256,
        "device": d.pop("device", None),
        "allocator": d.pop("allocator"),
        "options": format_options(options or {}),
        "capacity": capacity,
        "vmstoolkit": __version__,
    }
    if isinstance(extra.get("device"), str):  # the real driver names its GPU
        row["device_name"] = extra.pop("device")
    for k in ROW_KEYS:
        if k in d:
            row[k] = d.pop(k)
    row["seconds"] = round(row["seconds"], 4)
    row["events_per_second"] = round(row["events_per_second"], 1)
    if not row["oom"]:
        row["oom_message"] = ""
    calls = d.pop("driver_calls", {}) or {}
    row["driver_calls"] = sum(calls.values())  # the total; each call's count follows
    row.update(flatten({"driver_calls": calls}))
    row.update(flatten(extra))
    row.update(flatten(d))  # whatever else a replay reports (newer fields), flattened too
    return row


def union_fields(rows: Iterable[dict]) -> list[str]:
    """Every column of ``rows``, in the order they first appear."""
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def uniform(rows: list[dict]) -> list[dict]:
    """The rows flattened, each with every column of any of them: a driver call a row's allocator
    never made counts 0; any other column a row lacks (``paths.*`` of a non-VMM allocator) is ``None``."""
    flat = [flatten(r) for r in rows]
    cols = union_fields(flat)
    return [{k: r.get(k, 0 if k.startswith("driver_calls.") else None) for k in cols} for r in flat]


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v)
    return v


def rows_to_csv(rows: list[dict]) -> str:
    """CSV with the union of the rows' columns; a row without a column leaves its cell empty."""
    if not rows:
        return ""
    flat = uniform(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(flat[0]), lineterminator="\n")
    w.writeheader()
    for r in flat:
        w.writerow({k: _cell(v) for k, v in r.items()})
    return buf.getvalue()


def json_lines(rows: list[dict]) -> str:
    """One JSON object per row and line, with the CSV's columns (:func:`uniform`)."""
    return "".join(json.dumps(r, default=str) + "\n" for r in uniform(rows))
