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


def emit_rows(rows: list[dict], fmt: OutputFormat, table) -> None:
    """Print ``rows`` as JSON lines, CSV, or a table: ``table(rows)`` either returns a rich
    renderable (printed here; a table that is piped or captured gets 200 columns instead of being
    squeezed into 80) or prints itself and returns None."""
    if fmt is OutputFormat.json:
        typer.echo(json_lines(rows), nl=False)
    elif fmt is OutputFormat.csv:
        typer.echo(rows_to_csv(rows), nl=False)
    else:
        rendered = table(rows)
        if rendered is not None:
            from rich.console import Console

            console = Console()
            if not console.is_terminal:
                console = Console(width=200)
            console.print(rendered)


print_rows = emit_rows  # the name the train-offload command was written against

__all__ = ["OutputFormat", "fail", "size_option", "parse_options", "rows_to_csv", "json_lines", "emit_rows", "print_rows",
           "VmsError"]
