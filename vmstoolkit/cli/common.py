"""Pieces shared by the CLI commands: option types, error reporting, output formats."""

from __future__ import annotations

import csv
import io
import json
from enum import Enum

import typer

from vmstoolkit.errors import VmsError
from vmstoolkit.units import parse_size


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def fail(message: str, code: int = 1) -> None:
    """Print one error line and exit: the CLI's only way out on a user error."""
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(code=code)


def size_option(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        n = parse_size(value)
    except ValueError as e:
        fail(f"{what}: {e}", code=2)
    if n <= 0:
        fail(f"{what} must be positive, got {value!r}", code=2)
    return n


def parse_options(items: list[str] | None) -> dict:
    """``["reuse_max_ratio=2", "selection=largest-first"]`` -> keyword options for
    :func:`~vmstoolkit.pools.make_allocator`; numbers and true/false are converted, the rest
    stays text (sizes such as ``64MiB`` are parsed by the allocator)."""
    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(f"--option takes KEY=VALUE, got {item!r}", code=2)
        value = value.strip()
        if value.lower() in ("true", "false"):
            out[key.strip()] = value.lower() == "true"
            continue
        for conv in (int, float):
            try:
                out[key.strip()] = conv(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value
    return out


def rows_to_csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()})
    return buf.getvalue()


def json_lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=False) + "\n" for r in rows)


def load_options(gpu: int | None, lenient: bool, max_bytes: str | None, max_objects: int | None) -> dict:
    """Snapshot-loading keywords from the ``--gpu``, ``--lenient``, ``--max-bytes`` and
    ``--max-objects`` flags, checked."""
    if gpu is not None and gpu < 0:
        fail(f"--gpu must be a device number (0 or more), got {gpu}", code=2)
    if max_objects is not None and max_objects <= 0:
        fail(f"--max-objects must be positive, got {max_objects}", code=2)
    return {"gpu": gpu, "lenient": lenient, "max_bytes": size_option(max_bytes, "--max-bytes"),
            "max_objects": max_objects}


__all__ = ["OutputFormat", "load_options", "fail", "size_option", "parse_options", "rows_to_csv", "json_lines", "VmsError"]
