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


__all__ = ["OutputFormat", "fail", "size_option", "rows_to_csv", "json_lines", "VmsError"]
